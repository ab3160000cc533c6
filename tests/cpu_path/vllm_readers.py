"""vLLM's message-queue readers of the suite's processes wait for a message without spinning.

A vLLM engine of TP > 1 (the vLLM CPU build's servers and engines here) sends each step to its worker processes
through a shared-memory queue (`vllm.distributed.device_communicators.shm_broadcast`); a reader that got a message
spins (`sched_yield` in a loop) for `SpinCondition.busy_loop_s` = 1 s before it parks on the queue's notification
socket, to answer the next message at once under load. vLLM has no setting for it. The suite's servers serve a
token now and then (the fault tests ask a paused server every 2 s whether it serves again, and wait out leases):
measured on a 2-core machine, a TP-2 server asked for one token every 2 s used 28.9 CPU-s a minute spinning so, and
3.7 with the readers parked at once (busy_loop_s = 0; the same tokens), and 10 CPU-s less to start; on a 2-core
machine the spinning is CPU taken from the suite's other processes. Parked, a reader wakes on the notification the
writer sends with every message (vLLM's own idle path), so what the workers compute is unchanged.
"""
from __future__ import annotations

import sys
from types import ModuleType

from cpu_path_pin import AfterImport

QUEUE_MODULE = "vllm.distributed.device_communicators.shm_broadcast"


def _park_at_once(module: ModuleType) -> None:
    init = module.SpinCondition.__init__
    names = init.__code__.co_varnames[:init.__code__.co_argcount]
    if names[-1] != "busy_loop_s" or init.__defaults__ is None:  # another vLLM: leave it as it is
        return
    init.__defaults__ = (*init.__defaults__[:-1], 0.0)


def install() -> None:
    """Park vLLM's queue readers at once in this process, when it imports vLLM's queue module (never imports it)."""
    if QUEUE_MODULE in sys.modules:
        _park_at_once(sys.modules[QUEUE_MODULE])
    else:
        sys.meta_path.insert(0, AfterImport(QUEUE_MODULE, _park_at_once))
