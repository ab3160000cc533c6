"""An expert LoRA adapter (per expert, or one shared by all experts) of a tiny Qwen3-MoE refit by reshard into a
PEFT directory is read by vLLM 0.33's own loader as the adapter it was made of: every expert's gate / up / down A
and B equal the canonical tensors, scaled by alpha / r, and vLLM's packing of the experts (what
FusedMoEWithLoRA.set_lora receives) equals reshard's slot tensors at TP 1 (expert_lora_checks.py). vLLM cannot run
a MoE LoRA forward on CPU (no CPU MoE LoRA kernels), nor build FusedMoEWithLoRA there (its __init__ raises
"Old-style modular kernel not supported."), so no token parity and no live slot here."""
from __future__ import annotations

import json
import sys

import pytest

from vllm_harness import HERE, launch, wait

pytestmark = pytest.mark.vllm


def test_vllm_loads_reshard_expert_adapters(checkpoints, tmp_path):
    import expert_lora_checks as checks

    wait(launch(sys.executable, HERE / "expert_lora_checks.py", [str(tmp_path), str(checkpoints["qwen3_moe"])], 1,
                tmp_path), timeout=600)
    reports = json.loads((tmp_path / "report.json").read_text())
    assert sorted(reports) == ["per_expert", "shared"]
    for report in reports.values():
        assert report["problems"] == [], report
        layers, experts = 2, 4  # vllm_harness.TINY / TINY_MOE
        assert report["checked"] == layers * experts * 3 * 2 + layers * 3 * 2, report
        assert report["scalings"] == [checks.ALPHA / checks.RANK], report
