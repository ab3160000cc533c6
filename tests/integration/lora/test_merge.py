"""Landing (c): an adapter merged into base weights, W + (alpha / r) B A, byte for byte equal to a reference
merge in float32 cast once (harness.lora.reference_merge), after travelling from Megatron-Bridge shards
through the local executor and over gloo."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from safetensors.torch import load_file

import reshard
from reshard.adapters.lora import merge, merged_names
from reshard.errors import ExecutionError
from reshard.executors import execute_local, shard
from reshard.executors.reference import allocate
from reshard.layouts.lora import lora_spec
from harness.lora import adapter_weights, base_weights, reference_merge
from reshard.testing.megatron_cpu import TinyGPT
from reshard.testing.world import run_world

TINY = TinyGPT(num_layers=2)
MODULES = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj",
           "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}


def _reference(base: dict, adapter: dict, rank: int, alpha: float) -> dict[str, torch.Tensor]:
    """Every adapted base weight merged by the reference, the A / B of each written out by hand."""
    out = {}
    for name, w in base.items():
        module = name.split(".")[-2]
        if module not in MODULES or ".layers." not in name:
            continue
        block = name.rsplit(".", 2)[0]  # model.layers.{i}.self_attn / .mlp
        a = adapter[f"{block}.{MODULES[module]}.lora_A.weight"]
        b = adapter[f"{block}.{module}.lora_B.weight"]
        out[name] = reference_merge(w, a, b, alpha, rank)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


@pytest.mark.parametrize("dtype,tp,pp", [(torch.bfloat16, 2, 2), (torch.float32, 1, 1)])
def test_local_merge_equals_reference_bit_for_bit(dtype, tp, pp):
    base = TINY.spec(str(dtype).removeprefix("torch."))
    spec = lora_spec(base, 8, 12)  # alpha / r = 1.5: not a power of two, so where it is applied shows in the bits
    weights, adapter = base_weights(base, 0, dtype), adapter_weights(spec, 5, dtype=dtype)
    src, dst = reshard.MegatronLayout(model=spec, tp=tp, pp=pp), reshard.HfLayout(model=spec)
    whole = allocate(dst)
    execute_local(reshard.compile(src, dst), shard(src, adapter), whole)
    before = {n: t.clone() for n, t in weights.items()}
    merged = {n: torch.empty_like(t) for n, t in weights.items()}
    names = merge(spec, weights, whole[0], merged)
    want = _reference(before, adapter, 8, 12)
    assert sorted(names) == sorted(want) and len(want) == 7 * TINY.num_layers
    for name, w in want.items():
        assert torch.equal(_bits(merged[name]), _bits(w)), name
        assert not torch.equal(merged[name], before[name])
    assert all(torch.equal(weights[n], before[n]) for n in weights)  # the base is read, never written


@pytest.mark.parametrize("experts", ["per_expert", "shared"])
def test_moe_merge_adapts_every_expert_and_the_dense_layers(experts):
    """An expert adapter (per expert, or one shared by all) of a MoE model with one dense layer, from
    Megatron-Bridge's TEGroupedMLP adapters (ep 2, expert TP 2): each expert's gate / up / down and the dense
    layer's MLP merged as the reference says."""
    base = reshard.ModelSpec(family="qwen3_moe", hidden_size=16, num_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=4, intermediate_size=24, vocab_size=64, qk_norm=True,
                             num_experts=4, moe_intermediate_size=8, dense_layers=(0,), dtype="bfloat16")
    spec = lora_spec(base, 4, 12, expert_adapters=experts)
    weights, adapter = base_weights(base, 0), adapter_weights(spec, 3, dtype=torch.bfloat16)
    src = reshard.MegatronLayout(model=spec, tp=2, ep=2, etp=2, naming="te")
    whole = allocate(reshard.HfLayout(model=spec))
    execute_local(reshard.compile(src, reshard.HfLayout(model=spec)), shard(src, adapter), whole)
    merged = {n: torch.empty_like(t) for n, t in weights.items()}
    names = merge(spec, weights, whole[0], merged)
    per_expert = {n.replace(".experts.", f".experts.{e}."): t for n, t in adapter.items() if re.search(
        r"\.experts\.[a-z]", n) for e in range(4)} if experts == "shared" else {}  # the shared one, for each
    want = _reference(weights, {**adapter, **per_expert}, 4, 12)
    assert sorted(names) == sorted(want) and len(want) == 2 * 4 + 3 + 4 * 3  # attention x2, dense MLP, 4 experts
    for name, w in want.items():
        assert torch.equal(_bits(merged[name]), _bits(w)), name


def test_merge_refuses_mismatched_tensors_before_writing():
    base = TINY.spec("float32")
    spec = lora_spec(base, 4, 8, ["linear_qkv"])
    weights, adapter = base_weights(base, 0, torch.float32), adapter_weights(spec, 1)
    assert len(merged_names(spec)) == 3 * TINY.num_layers
    adapter.pop(next(n for n in adapter if ".k_proj.lora_B." in n))
    before = {n: t.clone() for n, t in weights.items()}
    with pytest.raises(ExecutionError, match="missing model.layers.0.self_attn.k_proj.lora_B.weight"):
        merge(spec, weights, adapter)
    assert all(torch.equal(weights[n], before[n]) for n in weights)


@pytest.mark.gloo
def test_merge_over_gloo_equals_reference_bit_for_bit(tmp_path):
    """Two trainer processes (Megatron-Bridge TP 2) send the adapter over gloo to process 0, which merges two
    successive refits; each equals the reference merge of that refit's adapter into the same base."""
    seeds, rank, alpha = [11, 12], 8, 12
    results = run_world(2, "harness.lora:merge_job",
                        {"tiny": dataclasses.asdict(TINY), "rank": rank, "alpha": alpha, "seeds": seeds,
                         "base_seed": 0, "out": str(tmp_path)}, tmp_path / "world", timeout=180)
    assert results[0] == {"step-0": 14, "step-1": 14} and results[1] == {}, (tmp_path / "world" / "logs.txt")
    base = TINY.spec("bfloat16")
    spec = lora_spec(base, rank, alpha)
    weights = base_weights(base, 0)
    for k, seed in enumerate(seeds):
        got = load_file(str(tmp_path / f"step-{k}.safetensors"))
        want = _reference(weights, adapter_weights(spec, seed, dtype=torch.bfloat16), rank, alpha)
        assert sorted(got) == sorted(want)
        for name, w in want.items():
            assert torch.equal(_bits(got[name]), _bits(w)), (k, name)
