"""What the suite changes in how vLLM starts in its processes -- never what vLLM computes.

The suite is CPU-bound on a 2-core machine (CI's). Sampling every process's CPU time through a whole run showed that
before it builds a model, every vLLM process (a server's front end and engine core, each world rank, each engine
actor) inspects the model class (`_ModelInfo.from_model_cls`) in a fresh Python subprocess, so that a GPU process
does not initialise CUDA early; that subprocess imports vLLM again: ~14 CPU-s each, 20 of them in 27 minutes of one
run (the on-disk cache vLLM keeps of the answers misses whenever ranks start together, or two vLLM builds share a
cache name). There is no CUDA here: the suite's processes run vLLM's same inspection in process
(`_run_in_subprocess` calls the function it is given).

Tried and dropped: parking vLLM's message-queue readers at once (`SpinCondition.busy_loop_s` = 0; vLLM spins them
for 1 s after each message). A TP-2 server asked a token every 2 s used 3.1 CPU-s a minute instead of 28.9, but
generation fell to about one token a second: a parked reader waited out its poll instead of being woken, and the
crossprocess stage ran far slower (BENCHMARKS.md, "vLLM's start-up in the suite's processes").

test_vllm_startup (tests/integration/vllm) checks the change in a child python of each vLLM build.
"""
from __future__ import annotations

import sys
from types import ModuleType
from typing import Callable

from cpu_path_pin import AfterImport

REGISTRY_MODULE = "vllm.model_executor.models.registry"


def _inspect_in_process(registry: ModuleType) -> None:
    if hasattr(registry, "_run_in_subprocess"):
        registry._run_in_subprocess = _call


def _call(fn: Callable):
    return fn()


def install() -> None:
    """Apply it to this process's vLLM when it imports the registry (never imports it itself). Idempotent."""
    if REGISTRY_MODULE in sys.modules:
        _inspect_in_process(sys.modules[REGISTRY_MODULE])
    elif not any(isinstance(f, AfterImport) and f.name == REGISTRY_MODULE for f in sys.meta_path):
        sys.meta_path.insert(0, AfterImport(REGISTRY_MODULE, _inspect_in_process))
