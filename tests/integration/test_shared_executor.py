"""The shared-memory executor between 2-4 spawned CPU processes (POSIX shared memory: the code path of CUDA IPC
on one GPU host).

- random plans (random models and topologies, colocation, random bindings onto the processes, staged and in
  place), each refit three times with new weights in the same tensors: byte-identical to the local executor;
- a sender killed mid-refit and a frozen one: every survivor raises a clear ExecutionError within the timeout
  and its destination tensors keep the previous refit's bytes; no segment of a finished executor is left in
  /dev/shm.
The failure cases bound each survivor's own time (harness.clock: wall time less the time its thread queued for a
CPU), so that a loaded 2-core machine does not break a bound on what the library decides.
"""
from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
from hypothesis import Phase, given, settings, strategies as st

import reshard
from reshard.executors.binding import Binding
from harness.refit_cases import tiny_deepseek
from harness.clock import on_own_clock
from harness.shm import left_behind, segments
from harness.store_procs import check_plan_results, launch, plan_worker
from reshard.testing.strategies import refits

PROCESSES = 4
JOBS = 16
REFITS = 3


def _draw_jobs(tmp: Path, device: str = "cpu") -> list[dict]:
    jobs: list[dict] = []

    @settings(max_examples=JOBS, derandomize=True, database=None, phases=[Phase.generate], deadline=None)
    @given(refits(), st.integers(0, 2**32 - 1))
    def draw(pair, seed):
        src, dst = pair
        rnd = random.Random(seed)
        colocated = rnd.random() < 0.3 and dst.num_ranks <= src.num_ranks
        plan = reshard.compile(src, dst, colocated=colocated)
        procs = rnd.randint(2, PROCESSES)
        if colocated:
            binding = Binding.colocated(src.num_ranks, dst.num_ranks)
            binding = Binding(tuple(p % procs for p in binding.src), tuple(p % procs for p in binding.dst))
        else:
            binding = Binding(tuple(rnd.sample([s % procs for s in range(src.num_ranks)], src.num_ranks)),
                              tuple(rnd.sample([(d + 1) % procs for d in range(dst.num_ranks)], dst.num_ranks)))
        options = {"staged": rnd.random() < 0.6, "timeout": 30.0}
        path = tmp / f"plan{len(jobs)}.npz"
        plan.save(path)
        jobs.append({"executor": "shared", "plan": str(path), "binding": binding.to_dict(), "options": options,
                     "seed": 100 * len(jobs), "refits": REFITS, "label": f"{src} -> {dst}, {binding}, {options}",
                     "device": device})

    draw()
    spec = tiny_deepseek()  # float32 router biases in a bfloat16 model
    plan = reshard.compile(reshard.MegatronLayout(model=spec, tp=2, ep=2), reshard.VllmLayout(model=spec, tp=2))
    plan.save(tmp / "deepseek.npz")
    jobs.append({"executor": "shared", "plan": str(tmp / "deepseek.npz"),
                 "binding": Binding((0, 1, 2, 3), (1, 3)).to_dict(), "options": {"staged": True, "timeout": 30.0},
                 "seed": 7, "refits": REFITS, "label": "deepseek float32 router bias", "device": device})
    return jobs


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_random_plans_match_local_executor_over_three_refits(tmp_path, device):
    """On "cuda" (the GPU machine, `-m gpu`): every process on the one GPU, bytes through CUDA IPC."""
    before = segments()
    jobs = _draw_jobs(tmp_path, device)
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    codes = launch(plan_worker, PROCESSES, (str(tmp_path),), timeout=300)
    assert codes == [0] * PROCESSES, f"workers exited with {codes}"
    check_plan_results(tmp_path, jobs, PROCESSES, REFITS)
    left = left_behind(before)
    assert not left, f"segments left behind: {left[:5]}"


def test_plans_with_relays_are_refused(tmp_path):
    from reshard.errors import ExecutionError
    from reshard.executors.shared import SharedExecutor

    spec = tiny_deepseek()
    plan = reshard.compile(reshard.MegatronLayout(model=spec), reshard.VllmLayout(model=spec, replicas=2), fanout=1)
    with pytest.raises(ExecutionError, match="without fan-out"):
        SharedExecutor(plan, Binding((0,), (1, 2)), 0, {}, {}, store=None)


@pytest.mark.parametrize("scenario", ["killed", "frozen"])
def test_lost_sender_fails_every_survivor_within_timeout_and_keeps_destinations(tmp_path, scenario):
    timeout = 4.0
    spec = reshard.ModelSpec(family="qwen3", hidden_size=64, num_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=300,
                             qk_norm=True)
    plan = reshard.compile(reshard.MegatronLayout(model=spec, tp=2), reshard.VllmLayout(model=spec, replicas=2))
    plan.save(tmp_path / "plan.npz")
    # process 0: source rank 0 (the victim); process 1: source rank 1 and destination rank 0; process 2: dst 1
    victim = 0
    (tmp_path / "failure.json").write_text(json.dumps({
        "executor": "shared", "plan": str(tmp_path / "plan.npz"), "binding": Binding((0, 1), (1, 2)).to_dict(),
        "options": {"timeout": timeout}}))

    def drive(store, procs):
        store.wait(["refit1/0", "refit1/1", "refit1/2"])
        if scenario == "killed":
            procs[victim].join(30)
        else:
            os.kill(procs[victim].pid, signal.SIGSTOP)
        store.set("go", b"1")
        end = time.monotonic() + 60
        while time.monotonic() < end and not all((tmp_path / f"result-{p}.json").exists() for p in (1, 2)):
            time.sleep(0.05)
        if procs[victim].is_alive():
            os.kill(procs[victim].pid, signal.SIGKILL)

    launch(on_own_clock("harness.store_procs", "failure_worker"), 3, (str(tmp_path), scenario, victim), timeout=120, on_started=drive)
    for p in (1, 2):
        r = json.loads((tmp_path / f"result-{p}.json").read_text())
        assert r["error"] is not None and r["error"].startswith("ExecutionError"), r
        assert "refit version 2 failed" in r["error"] and "left unchanged" in r["error"], r["error"]
        assert r["seconds"] < timeout + 2.0, f"process {p} took {r['seconds']:.1f} s of its own to fail"
        assert r["unchanged"], f"process {p}: destination tensors changed by a failed refit"
        assert r["reuse_error"] and "failed earlier" in r["reuse_error"], r["reuse_error"]
