"""FP8 block-scaled destinations against real vLLM 0.33 model code on CPU (gloo), Qwen3, Qwen3-MoE (experts'
w13 / w2 stacks; TP split and expert parallel) and DeepSeek-V3 (MLA projections, shared and routed experts, the
router kept bf16), at vLLM TP1 and TP2: the engine's parameters after a quantizing
refit from a Megatron layout equal, byte for byte, vLLM loading an FP8 checkpoint quantized from the same bf16
weights by the reference quantizer (harness.fp8_reference) -- direct install into the parameters and
loader install (the FP8 checkpoint's tensors through load_weights); the parameters vLLM's Fp8LinearMethod /
Fp8MoEMethod create equal the declared FP8 destination (names, shapes, dtypes); another block size or other
ignored modules are refused naming the tensors. What fp8_checks.py runs (in the session's world of each TP size:
conftest.py's vllm_worlds), and what it stands in for on CPU (vLLM's CUDA block-FP8 kernel's post-load step; MoE
compared before post-load processing), is in its docstring.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

CASES = {  # name -> (checkpoint, expert parallel, Megatron source layout, post-load processing compared)
    "qwen3": ("qwen3", False, "megatron:tp=2,pp=2", True),
    "qwen3_moe": ("qwen3_moe", False, "megatron:tp=2,ep=2,etp=1,pp=2", False),
    "qwen3_moe_ep": ("qwen3_moe", True, "megatron:tp=1,ep=4", False),
    "deepseek": ("deepseek_v3", False, "megatron:tp=2,ep=2,naming=te", False),
}
WORLDS = {1: ["qwen3", "qwen3_moe", "deepseek"], 2: ["qwen3", "qwen3_moe", "qwen3_moe_ep", "deepseek"]}
CHECKS = ["parameters_match_declared", "direct_install_matches_load_weights", "loader_install_matches_load_weights",
          "sender_quantization_halves_the_wire", "other_block_size_refused", "other_ignored_modules_refused"]


QUANT = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3"}
# MLA at 128-multiples per TP2 rank: q_b 4 x (128 + 64) / 2 rows, kv_b 4 x (128 + 128) / 2, kv_a 128 + 64 whole
DEEPSEEK = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=256,
                intermediate_size=256, moe_intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
                kv_lora_rank=128, q_lora_rank=128, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
                topk_method="noaux_tc", n_group=1, topk_group=1, norm_topk_prob=True, scoring_func="sigmoid",
                first_k_dense_replace=1, moe_layer_freq=1, hidden_act="silu", vocab_size=1000,
                max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000, rope_scaling=None,
                attention_bias=False, routed_scaling_factor=2.5, tie_word_embeddings=False, torch_dtype="bfloat16",
                num_nextn_predict_layers=0, quantization_config=QUANT)


def fp8_config(out: Path, family: str) -> Path:
    """A tiny FP8 block-quantized checkpoint's config (head_dim 128 and 128-multiple sizes, so TP2 splits no block);
    the weights never come from disk (load_format "dummy")."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    if family == "deepseek_v3":
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(DEEPSEEK, indent=1))
        return out

    common = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                  vocab_size=1000, intermediate_size=512, max_position_embeddings=256, dtype="bfloat16",
                  tie_word_embeddings=False)
    moe = dict(moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
               norm_topk_prob=True, mlp_only_layers=[])
    cfg = Qwen3Config(**common) if family == "qwen3" else Qwen3MoeConfig(**common, **moe)
    cfg.save_pretrained(out)
    c = json.loads((out / "config.json").read_text())
    c["architectures"] = ["Qwen3ForCausalLM" if family == "qwen3" else "Qwen3MoeForCausalLM"]
    c["quantization_config"] = QUANT
    (out / "config.json").write_text(json.dumps(c, indent=1))
    return out


def world_jobs(selected, checkpoints, out):
    """This module's cases for the session's worlds (conftest.vllm_worlds), per world the selected ones."""
    ckpts = {f: fp8_config(out / f, f) for f in ("qwen3", "qwen3_moe", "deepseek_v3")}
    return {world: [{"name": n, "ckpt": str(ckpts[CASES[n][0]]), "ep": CASES[n][1], "src": CASES[n][2],
                     "processed": CASES[n][3]} for n in names if n in selected[world]]
            for world, names in WORLDS.items() if world in selected}


@pytest.mark.parametrize("world,case,check", [pytest.param(w, n, c, id=f"tp{w}-{n}-{c}") for w, names in
                                              WORLDS.items() for n in names for c in CHECKS])
def test_fp8_destination(reports, world, case, check):
    for rank, report in enumerate(reports[world]):
        assert "setup" not in report[case], f"tp{world} rank {rank} {case}: {report[case].get('setup')}"
        assert report[case][check] == "ok", f"tp{world} rank {rank} {case}: {report[case][check]}"
