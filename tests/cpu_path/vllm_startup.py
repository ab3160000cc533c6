"""What the suite changes in how vLLM starts and idles in its processes -- never what vLLM computes.

The suite is CPU-bound on a 2-core machine (CI's), and sampling every process's CPU time through a whole run showed
two costs of vLLM's that buy the tests nothing:

- **Model inspection in a subprocess.** Before it builds a model, every vLLM process (a server's front end and
  engine core, each world rank, each engine actor) inspects the model class (`_ModelInfo.from_model_cls`) in a
  fresh Python subprocess, so that a GPU process does not initialise CUDA early; that subprocess imports vLLM
  again: ~14 CPU-s each, 20 of them in 27 minutes of one run (the on-disk cache vLLM keeps of the answers misses
  whenever ranks start together, or two vLLM builds share a cache name). There is no CUDA here: the suite's
  processes run vLLM's same inspection in process (`_run_in_subprocess` calls the function it is given).
- **Spinning queue readers.** A vLLM engine of TP > 1 sends each step to its worker processes through a
  shared-memory queue (`shm_broadcast`); a reader that got a message spins (`sched_yield` in a loop) for
  `SpinCondition.busy_loop_s` = 1 s before it parks on the queue's notification socket (vLLM has no setting for
  it). The fault tests ask paused servers every 2 s whether they serve again: a TP-2 server asked for one token
  every 2 s used 28.9 CPU-s a minute spinning so, 3.7 with its readers parked at once (the same tokens). Parked, a
  reader wakes on the notification the writer sends with every message (vLLM's own idle path).

test_vllm_startup (tests/integration/vllm) checks both in a child python of each vLLM build.
"""
from __future__ import annotations

import sys
from types import ModuleType
from typing import Callable

from cpu_path_pin import AfterImport

QUEUE_MODULE = "vllm.distributed.device_communicators.shm_broadcast"
REGISTRY_MODULE = "vllm.model_executor.models.registry"


def _park_readers_at_once(queue: ModuleType) -> None:
    init = queue.SpinCondition.__init__
    names = init.__code__.co_varnames[:init.__code__.co_argcount]
    if names[-1] == "busy_loop_s" and init.__defaults__:  # another vLLM: leave it as it is
        init.__defaults__ = (*init.__defaults__[:-1], 0.0)


def _inspect_in_process(registry: ModuleType) -> None:
    if hasattr(registry, "_run_in_subprocess"):
        registry._run_in_subprocess = _call


def _call(fn: Callable):
    return fn()


def install() -> None:
    """Apply both to this process's vLLM when it imports those modules (never imports them itself). Idempotent."""
    for name, change in ((QUEUE_MODULE, _park_readers_at_once), (REGISTRY_MODULE, _inspect_in_process)):
        if name in sys.modules:
            change(sys.modules[name])
        elif not any(isinstance(f, AfterImport) and f.name == name for f in sys.meta_path):
            sys.meta_path.insert(0, AfterImport(name, change))
