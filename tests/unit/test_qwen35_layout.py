"""Qwen3.5 / Qwen3.6 layout facts pinned by hand-written formulas (independent of the placement code): the Gated
DeltaNet stacks (Megatron in_proj [q;k;v;z;b;a] and conv1d [q;k;v] per rank, vLLM in_proj_qkvz / in_proj_ba), the
per-head vectors, the gated attention (Megatron per group [q; gate; k; v], vLLM [q,gate; k; v] per rank), shared
experts, the multimodal wrapper's name prefixes, discovery, and an exact plan for the published MoE config.
The validate workflow (tests/integration/families) pins the same names and shapes against real megatron-core / vLLM."""
from __future__ import annotations

import json
import math

import pytest
import torch

import reshard
from reshard.errors import LayoutError, ModelConfigError
from reshard.executors import shard
from reshard.layouts import HfLayout, MegatronLayout, VllmLayout
from reshard.layouts.families import discover
from reshard.planner import compile_plan

TEXT = {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "hidden_size": 8,
        "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"], "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 2, "vocab_size": 64, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 3, "linear_value_head_dim": 2,
        "linear_conv_kernel_dim": 4, "num_experts": 4, "moe_intermediate_size": 8,
        "shared_expert_intermediate_size": 4, "torch_dtype": "float32"}
WRAPPED = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
           "text_config": {**TEXT, "model_type": "qwen3_5_moe_text"}, "vision_config": {"depth": 1}}
SPEC = reshard.ModelSpec.from_hf_config(TEXT)
L0, L1 = "model.layers.0.", "model.layers.1."
Kd, Vd, nv = 2 * 3, 4 * 2, 4


def weights(spec):
    g = torch.Generator().manual_seed(3)
    return {t.name: torch.randn(t.shape, generator=g) for t in spec.tensors}


def chunk(x, r, tp=2):
    return x.chunk(tp, dim=0)[r]


def test_megatron_gdn_in_proj_and_conv1d_concatenate_each_parts_tp_slice():
    W = weights(SPEC)
    qkv, z = W[L0 + "linear_attn.in_proj_qkv.weight"], W[L0 + "linear_attn.in_proj_z.weight"]
    b, a = W[L0 + "linear_attn.in_proj_b.weight"], W[L0 + "linear_attn.in_proj_a.weight"]
    q, k, v = qkv.split([Kd, Kd, Vd])
    conv = W[L0 + "linear_attn.conv1d.weight"]
    cq, ck, cv = conv.split([Kd, Kd, Vd])
    out = shard(MegatronLayout(model=SPEC, tp=2), W)
    for r in range(2):
        rank = out[r]
        want = torch.cat([chunk(x, r) for x in (q, k, v, z, b, a)])
        assert torch.equal(rank["decoder.layers.0.self_attention.in_proj.weight"], want)
        assert rank["decoder.layers.0.self_attention.conv1d.weight"].shape == ((2 * Kd + Vd) // 2, 1, 4)
        assert torch.equal(rank["decoder.layers.0.self_attention.conv1d.weight"],
                           torch.cat([chunk(x, r) for x in (cq, ck, cv)]))
        for name in ("dt_bias", "A_log"):
            assert torch.equal(rank[f"decoder.layers.0.self_attention.{name}"], chunk(W[L0 + "linear_attn." + name], r))
        assert torch.equal(rank["decoder.layers.0.self_attention.out_proj.weight"],
                           W[L0 + "linear_attn.out_proj.weight"].chunk(2, dim=1)[r])
        # zero-centred in Megatron: it stores w - 1 of HF's plain gated-norm weight w
        assert torch.equal(rank["decoder.layers.0.self_attention.out_norm.weight"], W[L0 + "linear_attn.norm.weight"] - 1)
        assert torch.equal(rank["decoder.layers.0.input_layernorm.weight"], W[L0 + "input_layernorm.weight"])


def test_megatron_te_names_fuse_the_gdn_input_norm_into_in_proj():
    names = MegatronLayout(model=SPEC, tp=2, naming="te").rank_tensors(0)
    assert "decoder.layers.0.self_attention.in_proj.layer_norm_weight" in names
    assert "decoder.layers.0.input_layernorm.weight" not in names


def test_vllm_gdn_stacks():
    W = weights(SPEC)
    q, k, v = W[L0 + "linear_attn.in_proj_qkv.weight"].split([Kd, Kd, Vd])
    z = W[L0 + "linear_attn.in_proj_z.weight"]
    b, a = W[L0 + "linear_attn.in_proj_b.weight"], W[L0 + "linear_attn.in_proj_a.weight"]
    cq, ck, cv = W[L0 + "linear_attn.conv1d.weight"].split([Kd, Kd, Vd])
    out = shard(VllmLayout(model=SPEC, tp=2), W)
    p = "model.layers.0.linear_attn."
    for r in range(2):
        assert torch.equal(out[r][p + "in_proj_qkvz.weight"], torch.cat([chunk(x, r) for x in (q, k, v, z)]))
        assert torch.equal(out[r][p + "in_proj_ba.weight"], torch.cat([chunk(b, r), chunk(a, r)]))
        assert torch.equal(out[r][p + "conv1d.weight"], torch.cat([chunk(x, r) for x in (cq, ck, cv)]))
        assert torch.equal(out[r][p + "A_log"], chunk(W[L0 + "linear_attn.A_log"], r))


def _gated_heads(W, layer, nq, d):
    qp = W[f"model.layers.{layer}.self_attn.q_proj.weight"]
    return [qp[2 * h * d:(2 * h + 1) * d] for h in range(nq)], [qp[(2 * h + 1) * d:(2 * h + 2) * d] for h in range(nq)]


@pytest.mark.parametrize("kv", [2, 1])
def test_megatron_gated_linear_qkv_is_q_gate_k_v_per_group(kv):
    spec = reshard.ModelSpec.from_hf_config({**TEXT, "num_key_value_heads": kv})
    W = weights(spec)
    nq, d, hpg = 4, 2, 4 // kv
    qs, gates = _gated_heads(W, 1, nq, d)
    k, v = W[L1 + "self_attn.k_proj.weight"], W[L1 + "self_attn.v_proj.weight"]
    want = torch.cat([torch.cat([*qs[g * hpg:(g + 1) * hpg], *gates[g * hpg:(g + 1) * hpg], k[g * d:(g + 1) * d],
                                 v[g * d:(g + 1) * d]]) for g in range(kv)])
    out = shard(MegatronLayout(model=spec, tp=2), W)  # kv=1 < tp: the TP cut goes through the group
    for r in range(2):
        assert torch.equal(out[r]["decoder.layers.1.self_attention.linear_qkv.weight"], chunk(want, r))


@pytest.mark.parametrize("tp", [2, 4])
def test_vllm_gated_qkv_proj(tp):
    spec = reshard.ModelSpec.from_hf_config({**TEXT, "linear_num_key_heads": 4})  # GDN heads cut 4 ways too
    W = weights(spec)
    d, g = 2, 2
    qp, k, v = (W[L1 + f"self_attn.{x}_proj.weight"] for x in "qkv")
    out = shard(VllmLayout(model=spec, tp=tp), W)
    for r in range(tp):
        head = r * g // tp  # tp > g: KV head r // (tp / g), replicated
        kv = slice(head * d, (head + 1) * d) if tp >= g else slice(r * d, (r + 1) * d)
        want = torch.cat([qp.chunk(tp)[r], k[kv], v[kv]])
        assert torch.equal(out[r]["model.layers.1.self_attn.qkv_proj.weight"], want)


def test_shared_expert_on_both_sides():
    W = weights(SPEC)
    m = L0 + "mlp."
    gate, up, down = (W[m + f"shared_expert.{x}_proj.weight"] for x in ("gate", "up", "down"))
    meg, vll = shard(MegatronLayout(model=SPEC, tp=2, ep=2, etp=1), W), shard(VllmLayout(model=SPEC, tp=2), W)
    for r in range(2):
        fc1 = torch.cat([chunk(gate, r), chunk(up, r)])
        assert torch.equal(meg[r]["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"], fc1)
        assert torch.equal(vll[r]["model.layers.0.mlp.shared_expert.gate_up_proj.weight"], fc1)
        assert torch.equal(meg[r]["decoder.layers.0.mlp.shared_experts.linear_fc2.weight"], down.chunk(2, dim=1)[r])
        assert torch.equal(meg[r]["decoder.layers.0.mlp.shared_experts.gate_weight"], W[m + "shared_expert_gate.weight"])
        assert torch.equal(vll[r]["model.layers.0.mlp.shared_expert_gate.weight"], W[m + "shared_expert_gate.weight"])


def test_multimodal_wrapper_prefixes_names_and_excludes_the_vision_tower():
    spec = reshard.ModelSpec.from_hf_config(WRAPPED)
    names = [t.name for t in spec.tensors]
    assert [n.replace("model.language_model.", "model.") for n in names] == [t.name for t in SPEC.tensors]
    assert "lm_head.weight" in names and not any(n.startswith("model.layers") for n in names)
    vllm = VllmLayout(model=spec, tp=2).rank_tensors(0)
    assert all(n.startswith("language_model.model.") or n == "language_model.lm_head.weight" for n in vllm)
    assert set(VllmLayout(model=SPEC, tp=2).rank_tensors(0)) == {n[len("language_model."):] for n in vllm}
    assert MegatronLayout(model=spec, tp=2).rank_tensors(0) == MegatronLayout(model=SPEC, tp=2).rank_tensors(0)
    assert any("vision tower" in x for x in discover(WRAPPED).excluded(WRAPPED))


@pytest.mark.parametrize("arch,model_type", [("Qwen3_5ForCausalLM", "qwen3_5_text"),
                                             ("Qwen3_5ForConditionalGeneration", "qwen3_5"),
                                             ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
                                             ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe")])
def test_discovery(arch, model_type):
    assert discover({"architectures": [arch]}).name == "qwen3_5"
    assert discover({"model_type": model_type}).name == "qwen3_5"


def test_layer_types_default_to_every_fourth_layer_full():
    cfg = {k: v for k, v in TEXT.items() if k != "layer_types"}
    spec = reshard.ModelSpec.from_hf_config({**cfg, "num_hidden_layers": 8, "full_attention_interval": 4})
    assert spec.arch_value("layer_types") == ("linear_attention",) * 3 + ("full_attention",) + \
        ("linear_attention",) * 3 + ("full_attention",)
    assert "model.layers.3.self_attn.q_proj.weight" in {t.name for t in spec.tensors}


def test_bad_configs_and_layouts_are_refused():
    with pytest.raises(ModelConfigError, match="attn_output_gate"):
        reshard.ModelSpec.from_hf_config({**TEXT, "attn_output_gate": False})
    with pytest.raises(ModelConfigError, match="layer_types"):
        reshard.ModelSpec.from_hf_config({**TEXT, "layer_types": ["linear_attention", "sliding_attention"]})
    with pytest.raises(LayoutError, match="head counts"):  # 2 key heads cannot be cut 4 ways
        MegatronLayout(model=SPEC, tp=4)


@pytest.mark.parametrize("config", ["examples/configs/qwen3.5-35b-a3b.json", "examples/configs/qwen3.6-27b.json"])
def test_published_configs_plan_exactly(config):
    spec = reshard.ModelSpec.from_hf_config(config)
    cfg = json.load(open(config))
    assert spec.num_layers == cfg["text_config"]["num_hidden_layers"]
    moe = spec.is_moe
    src = MegatronLayout(model=spec, tp=2, pp=2, ep=8 if moe else 1, etp=1 if moe else None)
    for dst in (VllmLayout(model=spec, tp=2, replicas=2), HfLayout(model=spec)):
        plan = compile_plan(src, dst)
        held = sum(math.prod(p.lengths) for t in spec.tensors for p in dst.placements(t))  # replicated norms per rank
        assert plan.coverage == "exact"
        assert plan.accounting.total_bytes == plan.accounting.lower_bound_bytes == held * spec.itemsize
    assert held == spec.num_params  # HF: every canonical element once


def test_plans_shift_only_the_gdn_out_norm_between_megatron_and_hf_or_vllm():
    to_vllm = reshard.compile(MegatronLayout(model=SPEC, tp=2), reshard.VllmLayout(model=SPEC, tp=1))
    back = reshard.compile(reshard.VllmLayout(model=SPEC, tp=1), MegatronLayout(model=SPEC, tp=2))
    gdn = {t.index for t in SPEC.tensors if t.name.endswith("linear_attn.norm.weight")}
    assert gdn and to_vllm.value_shifts == {i: 1.0 for i in gdn}
    assert back.value_shifts == {i: -1.0 for i in gdn}
    assert reshard.compile(reshard.VllmLayout(model=SPEC, tp=1), reshard.VllmLayout(model=SPEC, tp=2)).value_shifts == {}


@pytest.mark.parametrize("undo", [False, True])
def test_refit_with_a_value_shift_lands_the_destination_layout(undo):
    """execute_local and the distributed executor's schedule (run in one process by harness.loopback) both
    deliver exactly shard(vLLM layout, W) from shard(Megatron layout, W): the +1 on the GDN out norm included."""
    from reshard.executors import allocate, execute_local
    from reshard.executors.binding import Binding
    from harness.loopback import run_loopback

    W = weights(SPEC)
    plan = reshard.compile(MegatronLayout(model=SPEC, tp=2), reshard.VllmLayout(model=SPEC, tp=2), colocated=True)
    src = shard(plan.src, W)  # stores w - 1 for the GDN out norm; the plan adds 1 back (rounded like this)
    want = shard(plan.dst, {n: (w - 1) + 1 if n.endswith("linear_attn.norm.weight") else w for n, w in W.items()},
                 fill=-5.0)
    got, loop = allocate(plan.dst, fill=-5.0), allocate(plan.dst, fill=-5.0)
    execute_local(plan, src, got)
    run_loopback(plan, Binding((0, 1), (1, 0)), src, loop, bucket_numel=4096, staged=not undo, undo=undo)
    for r in want:
        for n in want[r]:
            assert torch.equal(got[r][n], want[r][n]), (r, n)
            assert torch.equal(loop[r][n], want[r][n]), (r, n)
