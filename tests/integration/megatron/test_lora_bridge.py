"""Megatron-Bridge's adapters, built from megatron-core's own parallel linears as its ParallelLinearAdapter builds
them, on a real GPTModel at TP 2 (gloo), each shard filled at megatron-core's own sharded-state offsets: the
parameter names, local shapes and offsets are what `MegatronLayout` declares for the adapter spec, and a refit
from views of the live parameters (`adapters.megatron.source_tensors`) over gloo into a PEFT layout equals the
PEFT tensors written out by hand from megatron-core's global tensors (Megatron-Bridge's export: a fused layer's A
under each part, linear_qkv's B de-interleaved by query group, linear_fc1's B split per rank into gate and up).
(Megatron-Bridge itself does not install here: Python 3.12, transformers <= 5.12.1.)"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import reshard
from reshard.layouts.lora import lora_spec
from reshard.testing.lora import bridge_refit_job, global_value
from reshard.testing.megatron_cpu import TinyGPT, run_ranks

pytestmark = [pytest.mark.megatron, pytest.mark.gloo]
TP, RANK = 2, 8


def _global(layer: int, target: str, which: str, rows: int, cols: int) -> torch.Tensor:
    return torch.tensor([[global_value(layer, target, which, i, j) for j in range(cols)] for i in range(rows)])


def _expected_peft(tiny: TinyGPT) -> dict[str, torch.Tensor]:
    H, d, g, F = tiny.hidden_size, tiny.head_dim, tiny.num_query_groups, tiny.ffn_hidden_size
    hpg, q = tiny.num_attention_heads // g, tiny.num_attention_heads * tiny.head_dim
    out = {}
    for i in range(tiny.num_layers):
        p = f"base_model.model.model.layers.{i}."
        a = _global(i, "linear_qkv", "in", RANK, H)
        b = _global(i, "linear_qkv", "out", (hpg + 2) * d * g, RANK)
        groups = b.view(g, (hpg + 2) * d, RANK)  # megatron-core's linear_qkv rows: [q heads; k; v] per group
        parts = {"q_proj": groups[:, :hpg * d].reshape(-1, RANK), "k_proj": groups[:, hpg * d:(hpg + 1) * d].reshape(-1, RANK),
                 "v_proj": groups[:, (hpg + 1) * d:].reshape(-1, RANK)}
        for m, rows in parts.items():
            out[f"{p}self_attn.{m}.lora_A.weight"], out[f"{p}self_attn.{m}.lora_B.weight"] = a, rows
        out[f"{p}self_attn.o_proj.lora_A.weight"] = _global(i, "linear_proj", "in", RANK, q)
        out[f"{p}self_attn.o_proj.lora_B.weight"] = _global(i, "linear_proj", "out", H, RANK)
        a = _global(i, "linear_fc1", "in", RANK, H)
        per_rank = _global(i, "linear_fc1", "out", 2 * F, RANK).view(TP, 2, F // TP, RANK)  # [gate_r; up_r]
        for s, m in enumerate(("gate_proj", "up_proj")):
            out[f"{p}mlp.{m}.lora_A.weight"], out[f"{p}mlp.{m}.lora_B.weight"] = a, per_rank[:, s].reshape(F, RANK)
        out[f"{p}mlp.down_proj.lora_A.weight"] = _global(i, "linear_fc2", "in", RANK, F)
        out[f"{p}mlp.down_proj.lora_B.weight"] = _global(i, "linear_fc2", "out", H, RANK)
    return out


def test_bridge_adapters_refit_from_a_live_megatron_model(tmp_path):
    run_ranks(TP, bridge_refit_job, TP, str(tmp_path), RANK, errdir=str(tmp_path), timeout=240)
    tiny = TinyGPT(num_layers=2)
    spec = lora_spec(tiny.spec(), RANK, 16)
    layout = reshard.MegatronLayout(model=spec, tp=TP)
    for r in range(TP):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        declared = layout.rank_tensors(r)
        assert sorted(got["parameters"]) == sorted(declared)            # names, as the live model has them
        for name, shard in got["shards"].items():
            assert tuple(shard["local"]) == declared[name], name       # local shapes
            cut = [k for k, (n, m) in enumerate(zip(shard["global"], shard["local"])) if n != m]
            assert len(cut) == 1 and shard["offset"][cut[0]] == r * shard["local"][cut[0]], name
    got, want = load_file(str(tmp_path / "peft.safetensors")), _expected_peft(tiny)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
