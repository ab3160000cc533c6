"""Delta refits over the shared-memory and NIXL executors between 4 spawned CPU processes (harness.delta_jobs, the
cases of test_delta_gloo): every step byte-equal to a dense refit of the same source, keyframes where the policy and the
versions say, fewer payload bytes than dense; staged and in place, disjoint and colocated (local payloads); a
receiver that lost its version gets a keyframe; a payload corrupted in its outbox (checksums on) and one claiming
another base version fail every process before anything is written, and the rebuilt executor's first refit (a
keyframe) is right again. No outbox segment is left in /dev/shm."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import reshard
from harness.refit_cases import tiny_spec
from harness.shm import left_behind, segments
from harness.store_procs import launch
from reshard.executors.binding import Binding

PROCESSES = 4


@pytest.mark.parametrize("executor", ["shared", pytest.param("nixl", marks=pytest.mark.nixl)])
def test_delta_refits_over_voted_executors(tmp_path: Path, executor: str):
    if executor == "nixl":
        pytest.importorskip("nixl")

    before = segments()
    spec = tiny_spec().model_copy(update={"dtype": "bfloat16"})
    M, V = reshard.MegatronLayout, reshard.VllmLayout
    disjoint = reshard.compile(M(model=spec, tp=2), V(model=spec, tp=2)).save(tmp_path / "disjoint.npz")
    colocated = reshard.compile(M(model=spec, tp=2, pp=2), V(model=spec, tp=2, replicas=2),
                                colocated=True).save(tmp_path / "colocated.npz")
    base = {"seed": 5, "steps": 6, "fraction": 0.02, "keyframe_every": 4, "options": {"timeout": 60.0},
            "executor": executor}
    cases = [
        {**base, "plan": str(disjoint), "binding": Binding.disjoint(2, 2).to_dict()},
        {**base, "plan": str(colocated), "binding": Binding.colocated(4, 4).to_dict(), "stale": [2, 1],
         "options": {"timeout": 60.0, "staged": False}},
        {**base, "plan": str(disjoint), "binding": Binding.disjoint(2, 2).to_dict(), "steps": 5,
         "options": {"timeout": 60.0, "checksum": "sha256"}, "corrupt": [2, 0]},
        {**base, "plan": str(disjoint), "binding": Binding.disjoint(2, 2).to_dict(), "steps": 4,
         "corrupt_base": [2, 1]},
    ]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    codes = launch(_worker, PROCESSES, (str(tmp_path),), timeout=600)
    assert codes == [0] * PROCESSES, codes
    results = [json.loads((tmp_path / f"result-{p}.json").read_text()) for p in range(PROCESSES)]
    for proc, per_case in enumerate(results):
        for k, case in enumerate(per_case):
            assert "error" not in case, (k, proc, case.get("error"))
    steps = lambda k, proc: results[proc][k]["steps"]  # noqa: E731

    # disjoint, staged: keyframes at steps 0 and 4 (K = 4), deltas between, each right and smaller than dense
    for proc in range(PROCESSES):
        assert all(s["ok"] for s in steps(0, proc)), steps(0, proc)
    assert [s["keyframe"] for s in steps(0, 0)] == [True, False, False, False, True, False]
    for proc in (0, 1):  # the senders
        for s in steps(0, proc)[1:4]:
            assert 0 < s["sent"] == s["wire"] < s["dense"], s
    # colocated, in place: local payloads and sent ones; process 1's receiver lost its version before step 2
    for proc in range(PROCESSES):
        assert [s["ok"] for s in steps(1, proc)] == [True] * 6, steps(1, proc)
    assert [s["keyframe"] for s in steps(1, 0)] == [True, False, True, False, False, False]
    assert any(s["local"] > 0 for proc in range(PROCESSES) for s in steps(1, proc)[1:2])
    # corrupted in its outbox: every process fails at step 2 and keeps its destinations; the rebuilt executor's
    # first refit is a keyframe, the next a delta, both right
    for proc in range(PROCESSES):
        s = steps(2, proc)
        assert s[2].get("failed") and s[2]["kept"], s[2]
        assert s[3]["ok"] and s[3]["keyframe"] and s[4]["ok"] and not s[4]["keyframe"], s
    assert "checksum mismatch" in steps(2, 2)[2]["failed"] + steps(2, 3)[2]["failed"]
    # a payload on the wrong base: refused naming both versions, nothing written
    for proc in range(PROCESSES):
        s = steps(3, proc)
        assert s[2].get("failed") and s[2]["kept"] and s[3]["ok"] and s[3]["keyframe"], s
    refusal = steps(3, 2)[2]["failed"] + steps(3, 3)[2]["failed"]
    assert "computed against version 1, but the engine holds version 2" in refusal, refusal
    left = left_behind(before)
    assert not left, left


def _worker(process: int, port: int, workdir: str) -> None:
    from harness.delta_jobs import voted_delta_worker

    voted_delta_worker(process, port, workdir)
