"""Shared-memory segments of killed processes are reclaimed by the library (executors.shared.reclaim_segments):
a real process that made a segment (`shared_empty`, as an engine's loader buffers are made) and was SIGKILLed
leaves its name in /dev/shm; the next shared-memory executor made on the host removes it. Only names of the form
reshard creates, of this pid namespace, whose creator is provably gone (no such pid, or the pid reused by a process
that started at another time) are removed; a live creator's, another namespace's, an unreadable start time's and
the older form's are kept."""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys

import torch

import reshard
from reshard.executors import shard
from reshard.executors.binding import Binding
from reshard.executors.shared import SharedExecutor, _identity, reclaim_segments
from reshard.testing.megatron_cpu import TinyGPT

SHM = "/dev/shm"
CREATOR = """
import sys, time, torch
from reshard.executors.shared import Segment, shared_empty
t = shared_empty((256,), torch.float32)
print(Segment.holding(t)[0].name, flush=True)
time.sleep(600)
"""


def _creator() -> tuple[subprocess.Popen, str]:
    """A real process holding a segment it made with shared_empty; its name, read from its output."""
    proc = subprocess.Popen([sys.executable, "-c", CREATOR], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    name = proc.stdout.readline().strip()
    assert name.startswith("reshard-") and os.path.exists(os.path.join(SHM, name)), (name, proc.poll())
    return proc, name


def _file(name: str) -> str:
    path = os.path.join(SHM, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.close(fd)
    return name


def _receiver() -> SharedExecutor:
    """A real shared-memory executor: the receiving process of a tiny model's refit (its set-up makes its
    staging segment and waits for nobody), over an in-memory store."""
    spec = reshard.ModelSpec.from_hf_config(TinyGPT().hf_config().to_dict())
    plan = reshard.compile(reshard.HfLayout(model=spec), reshard.HfLayout(model=spec))
    dtype = getattr(torch, spec.dtype)
    dst = shard(plan.dst, {t.name: torch.zeros(t.shape, dtype=dtype) for t in spec.tensors}, ranks=[0])
    store = torch.distributed.HashStore()
    return SharedExecutor(plan, Binding.disjoint(1, 1), 1, {}, dst, store=store, timeout=5.0)


def test_a_killed_processs_segments_are_reclaimed_by_the_next_executor():
    pid, start, ns = _identity()
    hex32 = lambda: secrets.token_hex(16)  # noqa: E731
    reused = _file(f"reshard-{pid}-{start + 1}-{ns}-{hex32()}")  # this pid, another start: its creator is gone
    kept = [_file(f"reshard-{pid}-{start}-{ns}-{hex32()}"),  # this live process's own
            _file(f"reshard-{pid}-{start + 1}-{ns + 1}-{hex32()}"),  # another pid namespace's pid
            _file(f"reshard-{pid}-0-{ns}-{hex32()}"),  # a creator that could not read its start time
            _file(f"reshard-{pid}-{hex32()}"),  # the older form: nothing proves its creator gone
            _file(f"reshardx-{pid}-{start + 1}-{ns}-{hex32()}")]  # not a reshard name
    proc, name = _creator()
    try:
        assert name not in reclaim_segments() and os.path.exists(os.path.join(SHM, name))  # alive: kept
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert os.path.exists(os.path.join(SHM, name))  # a SIGKILLed process cannot remove its name
        executor = _receiver()
        try:
            assert not os.path.exists(os.path.join(SHM, name)), "the killed process's segment was not reclaimed"
            assert not os.path.exists(os.path.join(SHM, reused))
            for k in kept:
                assert os.path.exists(os.path.join(SHM, k)), k
            mine = [s.name for s in executor._created]
            assert mine and all(os.path.exists(os.path.join(SHM, n)) for n in mine)  # its own, made after
        finally:
            executor.close()
        assert not any(os.path.exists(os.path.join(SHM, n)) for n in mine)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for k in kept + [reused, name]:
            try:
                os.unlink(os.path.join(SHM, k))
            except FileNotFoundError:
                pass
