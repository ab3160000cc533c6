"""Megatron-Bridge's per-expert adapters (SequentialMLP: each local expert's ParallelLinearAdapter, is_expert=True),
built from megatron-core's own parallel linears on a real MoE GPTModel (gloo), each shard filled at the global
expert megatron-core's EP rank makes local expert j and at its expert-TP rank's offset: the parameter names and
local shapes are what `MegatronLayout` declares for the adapter spec, and a refit from views of the live
parameters over gloo into a PEFT layout equals the per-expert PEFT tensors written out by hand (gate / up B split
per expert-TP rank, each expert's A under gate_proj and up_proj)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import reshard
from reshard.layouts.lora import lora_spec
from harness.lora_experts import bridge_expert_refit_job, expert_value
from reshard.testing.megatron_cpu import TinyGPT, run_ranks

pytestmark = [pytest.mark.megatron, pytest.mark.gloo]
RANK, E = 4, 4


def _global(layer: int, e: int, target: str, which: str, rows: int, cols: int) -> torch.Tensor:
    return torch.tensor([[expert_value(layer, e, target, which, i, j) for j in range(cols)] for i in range(rows)])


def _expected_peft(tiny: TinyGPT, etp: int) -> dict[str, torch.Tensor]:
    H, F = tiny.hidden_size, tiny.moe_ffn_hidden_size
    out = {}
    for i in range(tiny.num_layers):
        for e in range(E):
            p = f"base_model.model.model.layers.{i}.mlp.experts.{e}."
            a = _global(i, e, "linear_fc1", "in", RANK, H)
            per_rank = _global(i, e, "linear_fc1", "out", 2 * F, RANK).view(etp, 2, F // etp, RANK)  # [gate_t; up_t]
            for s, m in enumerate(("gate_proj", "up_proj")):
                out[f"{p}{m}.lora_A.weight"], out[f"{p}{m}.lora_B.weight"] = a, per_rank[:, s].reshape(F, RANK)
            out[f"{p}down_proj.lora_A.weight"] = _global(i, e, "linear_fc2", "in", RANK, F)
            out[f"{p}down_proj.lora_B.weight"] = _global(i, e, "linear_fc2", "out", H, RANK)
    return out


@pytest.mark.parametrize("tp,ep,etp", [(2, 2, 1), (2, 1, 2)])
def test_bridge_expert_adapters_refit_from_a_live_megatron_moe(tmp_path, tp, ep, etp):
    world = 2
    run_ranks(world, bridge_expert_refit_job, tp, ep, etp, E, str(tmp_path), RANK, errdir=str(tmp_path), timeout=240)
    tiny = TinyGPT(num_layers=2, num_experts=E)
    layout = reshard.MegatronLayout(model=lora_spec(tiny.spec(), RANK, 16, ["linear_fc1", "linear_fc2"]), tp=tp,
                                    ep=ep, etp=etp)
    for r in range(world):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        declared = layout.rank_tensors(r)
        assert sorted(got) == sorted(declared)  # names, as the live model has them
        for name, shard in got.items():
            assert tuple(shard["local"]) == declared[name], name
    got, want = load_file(str(tmp_path / "peft.safetensors")), _expected_peft(tiny, etp)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
