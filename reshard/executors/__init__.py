"""Moving it: executors run a Plan and know nothing about Megatron or vLLM.

Every executor follows one protocol (executors.base): built once per plan, binding, process and tensors;
`refit()` at every weight update; `close()`. Executors are named after the transport that opens them
(adapters.transports), one module or package per transport; `make_executor(name, ...)` picks one by name:
- "inprocess" (executors.inprocess): every rank in this process, views made once (frequent small refits);
- "collective" (executors.collective): every process of a torch.distributed group (or of a group made over a store)
  runs its part, NCCL between GPUs, gloo between CPU processes;
- "nixl" (executors.nixl): NIXL one-sided reads / writes;
- "shared" (executors.shared): processes of one host through shared memory (CUDA IPC on GPUs, POSIX shared memory
  on CPU);
- "reference" (executors.reference): every rank in this process, any plan, nothing prepared: the ground truth the
  others are tested against (`execute_local` runs a whole plan).
`Fp8Executor` (executors.fp8) wraps one of them around an FP8 plan. What they share: `Binding` (which process plays
which plan rank), `partition` (who moves which op), `prepared` (a process's tensors checked and viewed), `views`,
`copies`, `checksum`, `preflight`, `exchange` and `voted` (store-based set-up and the commit vote), `stats`
(`RefitStats`, what every `refit()` returns). `shard` / `unshard` lay canonical weights out by a layout and back.
"""
from .base import Executor, RankTensors, make_executor
from .binding import Binding
from .collective.executor import CollectiveExecutor, execute_collective
from .reference import ReferenceExecutor, allocate, execute_local, shard, unshard
from .stats import RefitStats

__all__ = ["Binding", "CollectiveExecutor", "Executor", "ReferenceExecutor", "RankTensors", "RefitStats",
           "allocate", "execute_collective", "execute_local", "make_executor", "shard", "unshard"]
