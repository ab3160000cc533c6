"""Moving it: executors run a Plan and know nothing about Megatron or vLLM."""
from .local import allocate, execute_local, shard, unshard

__all__ = ["allocate", "execute_local", "shard", "unshard"]
