"""The layout facts of ../shared/REFERENCE.md, pinned by hand-written formulas (independent of the placement
code). The Megatron and vLLM adapter tests pin the same facts against the real libraries."""
from __future__ import annotations

import pytest
import torch

import reshard
from reshard.executors import shard
from harness.layouts import dense_rank, expert_rank

MHA_GQA = reshard.ModelSpec(family="qwen3", hidden_size=8, num_layers=4, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=2, intermediate_size=12, vocab_size=101, qk_norm=True,
                            dtype="float32")
MOE = reshard.ModelSpec(family="qwen3_moe", hidden_size=8, num_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=2, intermediate_size=0, vocab_size=64, qk_norm=True,
                        num_experts=4, moe_intermediate_size=6, dtype="float32")


def weights(spec):
    g = torch.Generator().manual_seed(1)
    return {t.name: torch.randn(t.shape, generator=g) for t in spec.tensors}


def test_megatron_qkv_is_interleaved_per_query_group():
    W = weights(MHA_GQA)
    d, g, hpg = 2, 2, 4
    q, k, v = (W[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    want = torch.cat([torch.cat([q[grp * hpg * d:(grp + 1) * hpg * d], k[grp * d:(grp + 1) * d],
                                 v[grp * d:(grp + 1) * d]]) for grp in range(g)])
    full = shard(reshard.MegatronLayout(model=MHA_GQA), W)[0]["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert torch.equal(full, want)
    tp2 = shard(reshard.MegatronLayout(model=MHA_GQA, tp=2), W)
    for r in range(2):  # a TP split on dim 0 gives rank r whole groups
        rows = want.shape[0] // 2
        assert torch.equal(tp2[r]["decoder.layers.0.self_attention.linear_qkv.weight"], want[r * rows:(r + 1) * rows])


def test_megatron_qkv_with_fewer_query_groups_than_tp_cuts_groups():
    """megatron-core 0.19 accepts g < tp: rank r holds contiguous rows of the interleaved matrix."""
    one_group = MHA_GQA.model_copy(update={"num_attention_heads": 4, "num_key_value_heads": 1})
    W = weights(one_group)
    d = 2
    q, k, v = (W[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    full = torch.cat([q, k, v])  # one group: [q0..q3; k; v]
    tp2 = shard(reshard.MegatronLayout(model=one_group, tp=2), W)
    assert torch.equal(tp2[0]["decoder.layers.0.self_attention.linear_qkv.weight"], full[:3 * d])  # q0 q1 q2
    assert torch.equal(tp2[1]["decoder.layers.0.self_attention.linear_qkv.weight"], full[3 * d:])  # q3 k v


def test_megatron_fc1_is_gate_r_up_r_per_rank_and_row_parallel_splits_dim1():
    W = weights(MHA_GQA)
    gate, up, down = (W[f"model.layers.1.mlp.{x}_proj.weight"] for x in ("gate", "up", "down"))
    o = W["model.layers.1.self_attn.o_proj.weight"]
    tp2 = shard(reshard.MegatronLayout(model=MHA_GQA, tp=2), W)
    for r in range(2):
        assert torch.equal(tp2[r]["decoder.layers.1.mlp.linear_fc1.weight"],
                           torch.cat([gate[r * 6:(r + 1) * 6], up[r * 6:(r + 1) * 6]]))
        assert torch.equal(tp2[r]["decoder.layers.1.mlp.linear_fc2.weight"], down[:, r * 6:(r + 1) * 6])
        assert torch.equal(tp2[r]["decoder.layers.1.self_attention.linear_proj.weight"], o[:, r * 8:(r + 1) * 8])


def test_megatron_vocab_padding_and_stage_placement():
    lay = reshard.MegatronLayout(model=MHA_GQA, tp=2, pp=2, vocab_divisor=64)
    assert lay.padded_vocab == 128  # multiple of 64 * tp
    t0 = lay.rank_tensors(dense_rank(lay, 0, 0, 0))
    assert t0["embedding.word_embeddings.weight"] == (64, 8) and "output_layer.weight" not in t0
    last = lay.rank_tensors(dense_rank(lay, 1, 0, 1))
    assert last["output_layer.weight"] == (64, 8) and "decoder.final_layernorm.weight" in last
    assert "decoder.layers.1.input_layernorm.weight" in last and "decoder.layers.2.input_layernorm.weight" not in last


def test_megatron_uneven_stages_and_vpp():
    lay = reshard.MegatronLayout(model=MHA_GQA.model_copy(update={"num_layers": 8}), pp=3, first_stage_layers=2,
                                 last_stage_layers=2)
    assert [lay.layer_home(i)[0] for i in range(8)] == [0, 0, 1, 1, 1, 1, 2, 2]
    v = reshard.MegatronLayout(model=MHA_GQA.model_copy(update={"num_layers": 8}), pp=2, vpp=2)
    # chunk c on stage s starts at c*(L/v) + s*(L/(p v)): stage 0 holds 0,1 and 4,5; stage 1 holds 2,3 and 6,7
    assert [v._layer_home[i][:2] for i in range(8)] == [(0, 0), (0, 0), (1, 0), (1, 0), (0, 1), (0, 1), (1, 1), (1, 1)]
    assert "model1.decoder.layers.0.input_layernorm.weight" in v.rank_tensors(0)


def test_megatron_tied_embeddings_keep_a_copy_on_the_last_stage():
    tied = MHA_GQA.model_copy(update={"tie_word_embeddings": True})
    lay = reshard.MegatronLayout(model=tied, pp=2)
    holders = {(p.rank, p.tensor) for p in lay.placements(tied.tensor("model.embed_tokens.weight"))}
    assert holders == {(0, "embedding.word_embeddings.weight"), (1, "output_layer.weight")}


def test_megatron_default_rank_order_formula():
    lay = reshard.MegatronLayout(model=MOE, tp=2, pp=2, ep=2, etp=1, world=8)
    T, DP = 2, 2
    for tp in range(2):
        for dp in range(2):
            for pp in range(2):
                assert dense_rank(lay, tp, dp, pp) == tp + T * dp + T * DP * pp
    ETP, EP, EDP = 1, 2, 2
    for ep in range(2):
        for edp in range(2):
            for pp in range(2):
                assert expert_rank(lay, 0, ep, edp, pp) == ETP * ep + ETP * EP * edp + ETP * EP * EDP * pp


def test_megatron_expert_numbering_and_names():
    lay = reshard.MegatronLayout(model=MOE, ep=2, etp=1, world=2)
    for e in range(4):
        t = MOE.tensor(f"model.layers.0.mlp.experts.{e}.gate_proj.weight")
        (p,) = lay.placements(t)
        assert p.rank == e // 2 and p.tensor == f"decoder.layers.0.mlp.experts.local_experts.{e % 2}.linear_fc1.weight"
    te = reshard.MegatronLayout(model=MOE, ep=2, etp=1, world=2, naming="te")
    (p,) = te.placements(MOE.tensor("model.layers.1.mlp.experts.3.down_proj.weight"))
    assert (p.rank, p.tensor) == (1, "decoder.layers.1.mlp.experts.linear_fc2.weight1")
    assert reshard.MegatronLayout(model=MOE, tp=2).etp == 2  # expert-TP defaults to TP


def test_vllm_qkv_stacks_q_k_v_and_replicates_kv_heads():
    W = weights(MHA_GQA)
    q, k, v = (W[f"model.layers.2.self_attn.{x}_proj.weight"] for x in "qkv")
    d = 2
    tp4 = shard(reshard.VllmLayout(model=MHA_GQA, tp=4), W)  # 2 KV heads, tp 4: each head on 2 ranks
    for r in range(4):
        head = r // 2
        want = torch.cat([q[r * 2 * d:(r + 1) * 2 * d], k[head * d:(head + 1) * d], v[head * d:(head + 1) * d]])
        assert torch.equal(tp4[r]["model.layers.2.self_attn.qkv_proj.weight"], want)
    tp2 = shard(reshard.VllmLayout(model=MHA_GQA, tp=2), W)
    for r in range(2):
        want = torch.cat([q[r * 8:(r + 1) * 8], k[r * d:(r + 1) * d], v[r * d:(r + 1) * d]])
        assert torch.equal(tp2[r]["model.layers.2.self_attn.qkv_proj.weight"], want)


def test_vllm_vocab_padding_rows_are_left_alone():
    lay = reshard.VllmLayout(model=MHA_GQA, tp=2)
    assert lay.padded_vocab == 128
    W = weights(MHA_GQA)
    out = shard(lay, W, fill=-1.0)
    emb = W["model.embed_tokens.weight"]
    assert torch.equal(out[0]["model.embed_tokens.weight"], emb[:64])
    assert torch.equal(out[1]["model.embed_tokens.weight"][:37], emb[64:])
    assert (out[1]["model.embed_tokens.weight"][37:] == -1).all()


@pytest.mark.parametrize("ep", [False, True])
def test_vllm_expert_stacks(ep):
    W = weights(MOE)
    lay = reshard.VllmLayout(model=MOE, tp=2, expert_parallel=ep)
    out = shard(lay, W)
    for r in range(2):
        w13 = out[r]["model.layers.0.mlp.experts.routed_experts.w13_weight"]
        w2 = out[r]["model.layers.0.mlp.experts.routed_experts.w2_weight"]
        experts = [2 * r, 2 * r + 1] if ep else [0, 1, 2, 3]
        assert w13.shape == (len(experts), 12 if ep else 6, 8)
        for slot, e in enumerate(experts):
            g, u, dn = (W[f"model.layers.0.mlp.experts.{e}.{x}_proj.weight"] for x in ("gate", "up", "down"))
            rows = slice(None) if ep else slice(r * 3, (r + 1) * 3)
            assert torch.equal(w13[slot], torch.cat([g[rows], u[rows]]))
            assert torch.equal(w2[slot], dn[:, rows])


def test_model_spec_from_published_configs():
    spec = reshard.ModelSpec.from_hf_config("examples/configs/qwen3-30b-a3b.json")
    assert spec.num_experts == 128 and spec.num_key_value_heads == 4 and spec.moe_intermediate_size == 768
    assert round(spec.num_params / 1e9, 1) == 30.5
    assert round(reshard.ModelSpec.from_hf_config("examples/configs/qwen3-8b.json").num_params / 1e9, 2) == 8.19
    assert round(reshard.ModelSpec.from_hf_config("examples/configs/llama-3.1-70b.json").num_params / 1e9, 1) == 70.6
    tied = reshard.ModelSpec.from_hf_config("examples/configs/qwen3-0.6b.json")
    assert tied.tie_word_embeddings and "lm_head.weight" not in {t.name for t in tied.tensors}


def test_unknown_architecture_lists_supported_ones():
    with pytest.raises(reshard.ModelConfigError, match="supported: DeepseekV3ForCausalLM, LlamaForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM"):
        reshard.ModelSpec.from_hf_config({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(reshard.ModelConfigError, match="missing"):
        reshard.ModelSpec.from_hf_config({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 8})
    with pytest.raises(reshard.ModelConfigError, match="attention_bias"):
        reshard.ModelSpec.from_hf_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 8,
                                          "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10,
                                          "intermediate_size": 4, "attention_bias": True})
