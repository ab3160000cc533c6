"""Quantizing refits across real processes over gloo (the distributed executor inside Fp8Executor): the FP8
engine's weights and scales equal an independently quantized checkpoint; a source process killed mid-refit
leaves every surviving destination with the previous refit's weights and scales, both."""
from __future__ import annotations

from pathlib import Path

import pytest

from reshard.executors.binding import Binding
from reshard.testing.world import run_world

pytestmark = pytest.mark.gloo


def config(intermediate: int) -> dict:
    return dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=128, vocab_size=500,
                intermediate_size=intermediate, torch_dtype="bfloat16")


def test_quantizing_refits_across_processes(tmp_path: Path):
    options = {"bucket_bytes": 4096, "timeout": 60.0, "direct_bytes": 1024}
    cases = [
        # every kind quantized by the senders: fp8 + scales on the wire
        {"config": config(512), "src": "megatron:tp=2", "dst": "vllm:tp=2", "block": [128, 128],
         "binding": Binding.disjoint(2, 2).to_dict(), "seed": 1, "options": options},
        # the trainer cuts the MLP through blocks: those kinds in bf16 to the receivers, who quantize; colocated
        {"config": config(384), "src": "megatron:tp=2,pp=2", "dst": "vllm:tp=1,replicas=2", "block": [128, 128],
         "binding": Binding.colocated(4, 2).to_dict(), "seed": 2, "colocated": True,
         "options": {**options, "undo": True}},
        # small blocks, in place
        {"config": config(384), "src": "megatron:tp=2,world=4", "dst": "vllm:tp=2", "block": [64, 32],
         "binding": Binding((0, 1, 2, 3), (0, 2)).to_dict(), "seed": 3, "options": {**options, "in_place": True}},
    ]
    results = run_world(4, "harness.fp8_jobs:run_cases", {"cases": cases}, tmp_path / "w", timeout=300)
    logs = (tmp_path / "w" / "logs.txt").read_text()
    assert all(r is not None for r in results), f"a process died:\n{logs[-3000:]}"
    for i in range(len(cases)):
        for proc in range(4):
            r = results[proc][i]
            assert r["ok"], f"case {i} process {proc}: {r['error']}"
    assert sum(results[p][0]["quantize_jobs"] for p in range(4)) > 0  # senders quantized
    assert sum(results[p][0]["receiver_jobs"] for p in range(4)) == 0
    assert sum(results[p][1]["receiver_jobs"] for p in range(4)) > 0  # and receivers did, where blocks were cut


def test_source_killed_mid_refit_keeps_previous_weights_and_scales(tmp_path: Path):
    case = {"config": config(384), "src": "megatron:tp=2", "dst": "vllm:tp=1", "block": [128, 128],
            "binding": Binding.disjoint(2, 1).to_dict(), "seed": 5, "kill": {"victim": 0, "at_round": 1},
            "options": {"bucket_bytes": 4096, "timeout": 5.0}}
    results = run_world(3, "harness.fp8_jobs:run_case", case, tmp_path / "w", timeout=120)
    logs = (tmp_path / "w" / "logs.txt").read_text()
    assert results[0] is None, "the victim should have died"
    r = results[2]
    assert r is not None, logs[-3000:]
    assert r["ok"], r["error"]
    assert r["second"].startswith("ExecutionError"), r["second"]
    assert r["kept_first"], "a destination changed although the refit failed"
