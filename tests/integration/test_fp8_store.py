"""Quantizing refits through the store-made executors, in spawned processes: NIXL (UCX over DRAM) and shared
memory, each inside Fp8Executor, twice with new weights: every engine tensor equals the reference checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from reshard.executors.binding import Binding
from harness.fp8_jobs import store_worker
from harness.store_procs import launch

pytestmark = pytest.mark.nixl


def test_fp8_refits_over_nixl_and_shared_memory(tmp_path: Path):
    pytest.importorskip("nixl")
    config = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=128, vocab_size=500,
                  intermediate_size=384, torch_dtype="bfloat16")  # the trainer cuts the MLP: senders and receivers
    common = {"config": config, "src": "megatron:tp=2", "dst": "vllm:tp=1", "block": [128, 128],
              "binding": Binding((0, 1), (1,)).to_dict(), "seed": 4}
    cases = [{**common, "executor": "nixl", "options": {"nixl": {"timeout": 60.0}}},
             {**common, "executor": "shared", "options": {"timeout": 60.0}}]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    codes = launch(store_worker, 2, (str(tmp_path),), timeout=240)
    assert codes == [0, 0], codes
    results = [json.loads((tmp_path / f"result-{p}.json").read_text()) for p in range(2)]
    for p in range(2):
        for r in results[p]:
            assert not r["error"], f"process {p} case {r['case']}: {r['error']}"
            assert r["ok"] == [True, True], f"process {p} case {r['case']}: {r['ok']}"
