"""Moving it: executors run a Plan and know nothing about Megatron or vLLM.

Every executor follows one protocol (executors.base): built once per plan, binding, process and tensors;
`refit()` at every weight update; `close()`. `make_executor(name, ...)` picks one by name:
- "local": every rank the call needs in this process (`execute_local` runs a whole plan: the reference);
- "distributed": every process of a torch.distributed group (or of a group made over a store: executors.comm)
  runs its part, NCCL between GPUs, gloo between CPU processes;
- "nixl": NIXL one-sided reads / writes (executors.nixl);
- "shared": processes of one host through shared memory (CUDA IPC on GPUs, POSIX shared memory on CPU).
Every `refit()` returns a `RefitStats` (executors.stats). A `Binding` says which process plays which plan rank.
`shard` / `unshard` lay canonical weights out by a layout and back (the reference the executors are tested against).
"""
from .base import Executor, RankTensors, make_executor
from .binding import Binding
from .distributed import DistributedExecutor, execute_distributed
from .local import LocalExecutor, allocate, execute_local, shard, unshard
from .stats import RefitStats

__all__ = ["Binding", "DistributedExecutor", "Executor", "LocalExecutor", "RankTensors", "RefitStats",
           "allocate", "execute_distributed", "execute_local", "make_executor", "shard", "unshard"]
