"""Delta refits on GPU tensors (run on the GPU machine: `-m gpu`): one process on one GPU holding every rank of a TP2
-> TP2 plan, so every payload is local, but the sender's scan and encoding, the receiver's proof, the GPU checksum
("sum64") and the Triton apply kernel all run on CUDA tensors. Every step byte-equal to a dense refit of the same
source by the reference executor; keyframes where the policy and the versions say; a payload corrupted after its
digest fails the refit with the destinations kept, and the next refit (a keyframe) is right again. The same across
two processes on the one GPU over NCCL (each a host of its own to NCCL, joined over loopback sockets:
reshard.testing.world), the payloads crossing between them: the delta exchange itself (sizes, then payloads) on
NCCL."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import reshard
from harness.refit_cases import tiny_spec
from reshard.executors.binding import Binding
from reshard.testing.world import run_world

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def _run(tmp_path: Path, world: int, binding: Binding) -> list[list]:
    spec = tiny_spec().model_copy(update={"dtype": "bfloat16"})
    plan = reshard.compile(reshard.MegatronLayout(model=spec, tp=2), reshard.VllmLayout(model=spec, tp=2),
                           colocated=True).save(tmp_path / "plan.npz")
    base = {"plan": str(plan), "binding": binding.to_dict(), "seed": 5, "steps": 6, "fraction": 0.02,
            "keyframe_every": 4, "options": {"timeout": 60.0}, "device": "cuda"}
    cases = [base, {**base, "stale": [2, 0]},
             {**base, "steps": 5, "options": {"timeout": 60.0, "checksum": "sum64"}, "corrupt": [2, 0]}]
    results = run_world(world, "harness.delta_jobs:run_delta_cases", {"cases": cases}, tmp_path / "world",
                        timeout=600, backend="nccl")
    logs = (tmp_path / "world" / "logs.txt").read_text()
    assert all(r is not None for r in results), f"a process died:\n{logs[-4000:]}"
    return [[r.get("steps") or r.get("error") for r in per_process] for per_process in results]


def _check(plain: list, stale: list, corrupt: list) -> None:
    """One process's steps: deltas between keyframes, smaller than dense; a lost version answered by a keyframe;
    the corrupted refit failed with the destinations kept, the next one a keyframe."""
    assert all(s.get("ok") for s in plain), plain
    assert [s["keyframe"] for s in plain] == [True, False, False, False, True, False]
    assert all(0 < s["wire"] < s["dense"] for s in plain[1:4]), plain
    assert [s["keyframe"] for s in stale] == [True, False, True, False, False, False] and all(s["ok"] for s in stale)
    assert corrupt[2].get("failed") and corrupt[2]["kept"], corrupt
    assert corrupt[3]["ok"] and corrupt[3]["keyframe"] and corrupt[4]["ok"] and not corrupt[4]["keyframe"], corrupt


def test_delta_refits_on_one_gpu(tmp_path: Path):
    (plain, stale, corrupt), = _run(tmp_path, 1, Binding((0, 0), (0, 0)))
    _check(plain, stale, corrupt)
    assert "checksum mismatch" in corrupt[2]["failed"], corrupt[2]


def test_delta_refits_across_two_processes_on_one_gpu(tmp_path: Path):
    """Source rank r on process r, destination rank r on process 1 - r: each process's deltas cross over NCCL."""
    results = _run(tmp_path, 2, Binding((0, 1), (1, 0)))
    for plain, stale, corrupt in results:
        _check(plain, stale, corrupt)
        assert all(s["sent"] > 0 for s in plain[1:4]), plain
    assert any("checksum mismatch" in corrupt[2]["failed"] for _, _, corrupt in results), results
