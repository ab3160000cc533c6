"""Family registry facts: discovery, the DeepSeek-V3 / Kimi-K2 tensors and their placements on both sides."""
from __future__ import annotations

import pytest
import torch

import reshard
from reshard.errors import ExecutionError, LayoutError, ModelConfigError
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


def test_tensors_kept_in_a_wider_dtype_travel_bit_exact(tmp_path):
    """DeepSeek's router bias is float32 in a bfloat16 model. The plan counts it in bfloat16 units (two per
    float32 element) and executors view it so: every bit arrives, checked against the canonical weights read
    back through the destination layout (values with low mantissa bits, which bfloat16 would round away)."""
    from reshard.executors import allocate, execute_local, shard, unshard

    spec = _tiny("examples/configs/deepseek-v3.json").model_copy(update={"dtype": "bfloat16"})
    src, dst = reshard.MegatronLayout(model=spec, tp=2, ep=2), reshard.VllmLayout(model=spec, tp=2)
    plan = reshard.compile(src, dst)
    biases = [t.name for t in spec.own_dtype_tensors]
    assert biases and plan.own_dtypes == {n: "float32" for n in biases}
    assert all(n.endswith("e_score_correction_bias") for n in biases)
    assert f"{len(biases)} tensors kept in float32 travel bit-exact" in str(plan)
    g = torch.Generator().manual_seed(0)
    weights = {t.name: (torch.randn(t.shape, generator=g) * (1 + 1e-3 * torch.rand(t.shape, generator=g)))
                        .to(torch.float32 if t.dtype == "float32" else torch.bfloat16) for t in spec.tensors}
    assert any(not torch.equal(weights[n], weights[n].to(torch.bfloat16).float()) for n in biases)
    got = allocate(dst, fill=-1.0)
    execute_local(plan, shard(src, weights), got)
    back = unshard(dst, got)
    for name, w in weights.items():
        assert back[name].dtype == w.dtype and torch.equal(back[name], w), name
    again = reshard.Plan.load(plan.save(tmp_path / "plan.npz"))  # the dtypes survive a save (JSON, arrays)
    assert again.digest == plan.digest and again.dst_tensors.dtypes == plan.dst_tensors.dtypes != ()
    # the bias alone, as a subset plan; a bfloat16 tensor where the plan wants float32 is refused by name
    sub = reshard.compile(src, dst, tensors=biases[:1])
    assert list(sub.own_dtypes) == biases[:1] and sub.accounting.model_bytes == 4 * spec.num_experts
    bad = allocate(dst, fill=0.0)
    name = next(n for (r, n) in dst.tensor_dtypes() if r == 0)
    bad[0][name] = bad[0][name].to(torch.bfloat16)
    with pytest.raises(ExecutionError, match=f"{name}.*plan expects .* torch.float32"):
        execute_local(plan, shard(src, weights), bad)
    qwen_spec = _tiny("examples/configs/qwen3-8b.json")
    qwen = reshard.compile(reshard.MegatronLayout(model=qwen_spec), reshard.VllmLayout(model=qwen_spec))
    assert qwen.own_dtypes == {} and "own dtype" not in str(qwen)
    assert not qwen.dst_tensors.dtypes and "dtypes" not in qwen.dst_tensors.to_dict()
