"""Delta refits across real processes (gloo): every step equal to a dense refit of the same source, keyframes where
the policy and the versions say, fewer bytes than dense on the wire; a receiver that lost its version gets a
keyframe; a payload corrupted in flight fails every process with checksums on and leaves every destination as it
was, and the next refit (a keyframe) is right again. The apply kernel through Triton's interpreter."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import reshard
from harness import pythonpath
from harness.refit_cases import tiny_spec
from reshard.executors.binding import Binding
from reshard.testing.world import run_world

pytestmark = pytest.mark.gloo
WORLD = 4


def test_delta_refits_across_processes(tmp_path: Path):
    spec = tiny_spec().model_copy(update={"dtype": "bfloat16"})
    M, V = reshard.MegatronLayout, reshard.VllmLayout
    disjoint = reshard.compile(M(model=spec, tp=2), V(model=spec, tp=2)).save(tmp_path / "disjoint.npz")
    colocated = reshard.compile(M(model=spec, tp=2, pp=2), V(model=spec, tp=2, replicas=2),
                                colocated=True).save(tmp_path / "colocated.npz")
    base = {"seed": 5, "steps": 6, "fraction": 0.02, "keyframe_every": 4, "options": {"timeout": 60.0}}
    cases = [
        {**base, "plan": str(disjoint), "binding": Binding.disjoint(2, 2).to_dict()},
        {**base, "plan": str(colocated), "binding": Binding.colocated(4, 4).to_dict(), "stale": [2, 1]},
        {**base, "plan": str(disjoint), "binding": Binding.disjoint(2, 2).to_dict(), "steps": 5,
         "options": {"timeout": 60.0, "checksum": "sha256"}, "corrupt": [2, 0]},
        # a receiver's read fails (not a refusal): voted, so its peers fail now; waiting out their timeout of an
        # hour would outlive the world's 600 s and fail the test
        {**base, "plan": str(disjoint), "binding": Binding.disjoint(2, 2).to_dict(), "steps": 4,
         "options": {"timeout": 3600.0}, "fail_read": [2, 3]},
    ]
    results = run_world(WORLD, "harness.delta_jobs:run_delta_cases", {"cases": cases}, tmp_path / "world",
                        timeout=600)
    logs = (tmp_path / "world" / "logs.txt").read_text()
    assert all(r is not None for r in results), f"a process died:\n{logs[-4000:]}"
    for proc, per_case in enumerate(results):
        for k, case in enumerate(per_case):
            assert "error" not in case, (k, proc, case.get("error"))
    steps = lambda k, proc: results[proc][k]["steps"]  # noqa: E731

    # disjoint: keyframes at steps 0 and 4 (K = 4), deltas between, each right and smaller on the wire
    for proc in range(WORLD):
        for s in steps(0, proc):
            assert s["ok"], s
    kinds = [s["keyframe"] for s in steps(0, 0)]
    assert kinds == [True, False, False, False, True, False]
    for proc in (0, 1):  # the senders
        for s in steps(0, proc)[1:4]:
            assert 0 < s["sent"] == s["wire"] < s["dense"], s
    # colocated: local payloads and sent ones; process 1's receiver lost its version before step 2: a keyframe
    for proc in range(WORLD):
        assert [s["ok"] for s in steps(1, proc)] == [True] * 6
    assert [s["keyframe"] for s in steps(1, 0)] == [True, False, True, False, False, False]  # K counts from step 2
    assert any(s["local"] > 0 for proc in range(WORLD) for s in steps(1, proc)[1:2])
    # corrupted in flight: every process fails at step 2 and keeps its destinations; step 3 is a keyframe
    for proc in range(WORLD):
        s = steps(2, proc)
        assert s[2].get("failed") and s[2]["kept"], s[2]
        assert s[3]["ok"] and s[3]["keyframe"] and s[4]["ok"] and not s[4]["keyframe"], s
    assert "checksum mismatch" in steps(2, 2)[2]["failed"] + steps(2, 3)[2]["failed"]
    # a receiver's read raised: every process fails at step 2 with its destinations kept, the next refit a keyframe
    for proc in range(WORLD):
        s = steps(3, proc)
        assert s[2].get("failed") and s[2]["kept"], s[2]
        assert s[3]["ok"] and s[3]["keyframe"], s
    assert "OutOfMemoryError" in steps(3, 3)[2]["failed"], steps(3, 3)[2]


def test_delta_apply_kernel_equals_torch_scatter():
    pytest.importorskip("triton")
    code = ("import json; from harness import delta_jobs as k; print(json.dumps(k.check_apply_kernel('cpu', 4)))")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=pythonpath())
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
