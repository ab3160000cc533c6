"""Adapter plans through the cross-process executors: NIXL (reads and writes) and shared memory (staged and in
place), between three spawned CPU processes, three refits each with new adapter values in the same tensors:
byte-identical to the local executor. Adapter layouts travel in plan files like any other (and are re-proved)."""
from __future__ import annotations

import json

import pytest

import reshard
from reshard.executors.binding import Binding
from reshard.layouts.lora import PeftLayout, VllmLoraLayout, lora_spec
from reshard.planner import Plan
from reshard.testing.megatron_cpu import TinyGPT
from harness.store_procs import launch, plan_worker

PROCESSES, REFITS = 3, 3


def test_adapter_plans_over_nixl_and_shared_memory(tmp_path):
    spec = lora_spec(TinyGPT(num_layers=2).spec("bfloat16"), 8, 16)
    src = reshard.MegatronLayout(model=spec, tp=2)
    plans = {"slots": reshard.compile(src, VllmLoraLayout(model=spec, tp=2, max_lora_rank=16)),
             "sharded": reshard.compile(src, VllmLoraLayout(model=spec, tp=2, max_lora_rank=8, fully_sharded=True)),
             "peft": reshard.compile(src, PeftLayout(model=spec))}
    jobs = []
    for name, plan in plans.items():
        path = tmp_path / f"{name}.npz"
        plan.save(path)
        assert Plan.load(path).digest == plan.digest
        binding = Binding((0, 1), (1, 2)) if plan.dst.num_ranks == 2 else Binding((0, 1), (2,))
        for executor, options in (("nixl", {"direction": "read", "staged": True}),
                                  ("nixl", {"direction": "write", "staged": False}),
                                  ("shared", {"staged": True}), ("shared", {"staged": False})):
            jobs.append({"executor": executor, "plan": str(path), "binding": binding.to_dict(),
                         "options": {**options, "timeout": 30.0}, "seed": 10 * len(jobs), "refits": REFITS,
                         "label": f"{name} {executor} {options}", "device": "cpu"})
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    codes = launch(plan_worker, PROCESSES, (str(tmp_path),), timeout=300)
    assert codes == [0] * PROCESSES, f"workers exited with {codes}"
    problems, seen = [], {k: 0 for k in range(len(jobs))}
    for p in range(PROCESSES):
        for r in json.loads((tmp_path / f"result-{p}.json").read_text()):
            seen[r["job"]] += 1
            if r["errors"] or r["ok"] != [True] * REFITS:
                problems.append(f"{jobs[r['job']]['label']} process {p}: {r['errors'] or r['ok']}")
    assert not problems, "\n".join(problems)
    assert all(n > 0 for n in seen.values()), seen


pytestmark = pytest.mark.nixl
