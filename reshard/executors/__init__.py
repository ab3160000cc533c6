"""Moving it: executors run a Plan and know nothing about Megatron or vLLM.

- `execute_local`: every rank in one process (the reference);
- `DistributedExecutor` / `execute_distributed`: every process of a torch.distributed group runs its part,
  NCCL between GPUs, gloo between CPU processes; a `Binding` says which process plays which plan rank.
"""
from .binding import Binding
from .distributed import DistributedExecutor, ExecutionStats, execute_distributed
from .local import allocate, execute_local, shard, unshard

__all__ = ["Binding", "DistributedExecutor", "ExecutionStats", "allocate", "execute_distributed", "execute_local",
           "shard", "unshard"]
