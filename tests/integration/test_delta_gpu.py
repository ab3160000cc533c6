"""Delta refits on GPU tensors (run on the GPU machine: `-m gpu`): one process on one GPU holding every rank of a TP2
-> TP2 plan, so every payload is local, but the sender's scan and encoding, the receiver's proof, the GPU checksum
("sum64") and the Triton apply kernel all run on CUDA tensors. Every step byte-equal to a dense refit of the same
source by the reference executor; keyframes where the policy and the versions say; a payload corrupted after its
digest fails the refit with the destinations kept, and the next refit (a keyframe) is right again. (Two processes
over NCCL need two GPUs: the collective executor's delta exchange ran across processes on gloo, test_delta_gloo.)"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import reshard
from harness.refit_cases import tiny_spec
from reshard.executors.binding import Binding
from reshard.testing.world import run_world

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def test_delta_refits_on_one_gpu(tmp_path: Path):
    spec = tiny_spec().model_copy(update={"dtype": "bfloat16"})
    plan = reshard.compile(reshard.MegatronLayout(model=spec, tp=2), reshard.VllmLayout(model=spec, tp=2),
                           colocated=True).save(tmp_path / "plan.npz")
    one = Binding((0, 0), (0, 0)).to_dict()
    base = {"plan": str(plan), "binding": one, "seed": 5, "steps": 6, "fraction": 0.02, "keyframe_every": 4,
            "options": {"timeout": 60.0}, "device": "cuda"}
    cases = [base, {**base, "stale": [2, 0]},
             {**base, "steps": 5, "options": {"timeout": 60.0, "checksum": "sum64"}, "corrupt": [2, 0]}]
    results = run_world(1, "harness.delta_jobs:run_delta_cases", {"cases": cases}, tmp_path / "world",
                        timeout=600, backend="nccl")
    logs = (tmp_path / "world" / "logs.txt").read_text()
    assert results[0] is not None, f"the process died:\n{logs[-4000:]}"
    plain, stale, corrupt = (r.get("steps") or r.get("error") for r in results[0])
    assert all(s.get("ok") for s in plain), plain
    assert [s["keyframe"] for s in plain] == [True, False, False, False, True, False]
    assert all(0 < s["wire"] < s["dense"] for s in plain[1:4]), plain
    assert [s["keyframe"] for s in stale] == [True, False, True, False, False, False] and all(s["ok"] for s in stale)
    assert corrupt[2].get("failed") and corrupt[2]["kept"], corrupt
    assert "checksum mismatch" in corrupt[2]["failed"], corrupt[2]
    assert corrupt[3]["ok"] and corrupt[3]["keyframe"] and corrupt[4]["ok"] and not corrupt[4]["keyframe"], corrupt
