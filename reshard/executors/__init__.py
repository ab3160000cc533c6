"""Moving it: executors run a Plan and know nothing about Megatron or vLLM.

Every executor follows executors.base's protocol and is picked by name with `make_executor`: "inprocess" (every
rank here, views made once), "collective" (torch.distributed: NCCL / gloo), "nixl" (one-sided reads / writes),
"shared" (one host, shared memory / CUDA IPC) and "reference" (the ground truth; `execute_local` runs a whole
plan). `Fp8Executor` (executors.fp8) wraps one around an FP8 plan. `shard` / `unshard` lay canonical weights out
by a layout and back.
"""
from .base import Executor, RankTensors, RefitStats, make_executor
from .binding import Binding
from .collective.executor import CollectiveExecutor, execute_collective
from .reference import ReferenceExecutor, allocate, execute_local, shard, unshard

__all__ = ["Binding", "CollectiveExecutor", "Executor", "ReferenceExecutor", "RankTensors", "RefitStats",
           "allocate", "execute_collective", "execute_local", "make_executor", "shard", "unshard"]
