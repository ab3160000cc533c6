"""Family registry facts: discovery, the DeepSeek-V3 / Kimi-K2 tensors and their placements on both sides."""
from __future__ import annotations

import pytest

import reshard
from reshard.errors import LayoutError, ModelConfigError
from reshard.layouts import MegatronLayout, VllmLayout, supported_architectures
from reshard.layouts.families import discover, read_hf_config


def _tiny(path):
    c = read_hf_config(path)
    fam = discover(c)
    return fam.spec(fam.tiny_config(c))


def test_published_sizes():
    v3 = reshard.ModelSpec.from_hf_config("examples/configs/deepseek-v3.json")
    k2 = reshard.ModelSpec.from_hf_config("examples/configs/kimi-k2.json")
    assert round(v3.num_params / 1e9) == 671  # without the 14B multi-token-prediction module
    assert round(k2.num_params / 1e12, 2) == 1.03
    assert v3.dense_layers == (0, 1, 2) and k2.dense_layers == (0,)
    assert "DeepseekV3ForCausalLM" in supported_architectures()


def test_refusals_are_clear():
    c = read_hf_config("examples/configs/deepseek-v3.json")
    with pytest.raises(ModelConfigError, match="multi-token-prediction"):
        reshard.ModelSpec.from_hf_config(c, include_mtp=True)
    with pytest.raises(ModelConfigError, match="quantized checkpoint"):
        reshard.ModelSpec.from_hf_config({**c, "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ModelConfigError, match="moe_layer_freq=2"):
        reshard.ModelSpec.from_hf_config({**c, "moe_layer_freq": 2})
    with pytest.raises(ModelConfigError, match="family='nope' is not registered"):
        reshard.ModelSpec(family="nope", hidden_size=8, num_layers=1, num_attention_heads=1, num_key_value_heads=1,
                          head_dim=8, intermediate_size=8, vocab_size=8)


def test_mla_placements():
    spec = _tiny("examples/configs/deepseek-v3.json")
    qa = spec.tensor("model.layers.1.self_attn.q_a_proj.weight")
    kva = spec.tensor("model.layers.1.self_attn.kv_a_proj_with_mqa.weight")
    # vLLM: both whole, stacked in fused_qkv_a_proj
    v = VllmLayout(model=spec, tp=2)
    assert [(p.rank, p.tensor, p.shape, p.phys_offset) for p in v.placements(kva)] == [
        (r, "model.layers.1.self_attn.fused_qkv_a_proj.weight", (56, 64), (32, 0)) for r in (0, 1)]
    # Megatron local: TP row blocks of linear_q_down_proj; TE: whole on every rank; router bias stays float32
    m = MegatronLayout(model=spec, tp=2)
    assert [(p.rank, p.shape, p.canon_offset, p.lengths) for p in m.placements(qa)] == [
        (0, (16, 64), (0, 0), (16, 64)), (1, (16, 64), (16, 0), (16, 64))]
    te = MegatronLayout(model=spec, tp=2, naming="te")
    assert {p.shape for p in te.placements(qa)} == {(32, 64)}
    assert spec.tensor("model.layers.1.mlp.gate.e_score_correction_bias").dtype == "float32"
    with pytest.raises(LayoutError, match="kv_a_proj_with_mqa.*not divisible by tp=16"):
        MegatronLayout(model=spec.model_copy(update={"num_attention_heads": 16, "num_key_value_heads": 16}), tp=16)


def test_existing_families_keep_their_shared_roles():
    spec = reshard.ModelSpec.from_hf_config("examples/configs/qwen3-30b-a3b.json")
    assert all(isinstance(t.role, reshard.Role) for t in spec.tensors)


def test_tensors_kept_in_a_wider_dtype_are_named_by_the_plan():
    """Plans move one dtype; DeepSeek's float32 router bias travels as bfloat16. The plan says so (and the
    dry run prints it) instead of rounding silently; a model without such tensors says nothing."""
    from reshard.planner.report import summary

    spec = _tiny("examples/configs/deepseek-v3.json").model_copy(update={"dtype": "bfloat16"})
    assert not reshard.compile(reshard.MegatronLayout(model=spec.model_copy(update={"dtype": "float32"})),
                               reshard.VllmLayout(model=spec.model_copy(update={"dtype": "float32"}))).narrowed
    plan = reshard.compile(reshard.MegatronLayout(model=spec), reshard.VllmLayout(model=spec))
    biases = [t.name for t in spec.tensors if t.name.endswith("e_score_correction_bias")]
    assert biases and plan.narrowed == {n: "float32" for n in biases}
    assert f"{len(biases)} float32 tensor" in summary(plan) and "arrive rounded" in summary(plan)
    sub = reshard.compile(reshard.MegatronLayout(model=spec), reshard.VllmLayout(model=spec), tensors=biases[:1])
    assert list(sub.narrowed) == biases[:1]
    qwen_spec = _tiny("examples/configs/qwen3-8b.json")
    qwen = reshard.compile(reshard.MegatronLayout(model=qwen_spec), reshard.VllmLayout(model=qwen_spec))
    assert qwen.narrowed == {} and "narrowed" not in summary(qwen)
