"""FP8 block-scaled destinations: the scheme read from quantization_config, the destination's tensors, where
blocks are quantized, the wire bytes, refits against an independently written reference checkpoint, and bad
input refused before any byte moves."""
from __future__ import annotations

import json

import pytest
import torch

import reshard
from reshard.errors import ExecutionError, LayoutError, ModelConfigError
from reshard.executors.fp8 import Fp8Executor, quantize_blocks
from reshard.executors.reference import allocate, shard
from reshard.layouts.fp8 import Fp8Scheme, quantized_entries
from reshard.planner.fp8 import compile_fp8
from harness.fp8_jobs import execute_fp8_local
from harness.fp8_reference import reference_checkpoint, reference_quantize, same_bytes

M, V, H = reshard.MegatronLayout, reshard.VllmLayout, reshard.HfLayout
SENTINEL = -7.0


def qwen3(intermediate: int = 512, dtype: str = "bfloat16", **extra) -> reshard.ModelSpec:
    cfg = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=256, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=128, vocab_size=500,
               intermediate_size=intermediate, torch_dtype=dtype, **extra)
    return reshard.ModelSpec.from_hf_config(cfg)


def qwen3_moe() -> reshard.ModelSpec:
    cfg = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=256, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=128, vocab_size=500, intermediate_size=512,
               moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2, torch_dtype="bfloat16")
    return reshard.ModelSpec.from_hf_config(cfg)


def weights(spec: reshard.ModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {t.name: (torch.randn(t.shape, generator=g) * 0.05).to(getattr(torch, spec.dtype)) for t in spec.tensors}


def expected(fp, w: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """The reference checkpoint laid out as the FP8 engine holds it."""
    quantized = {t.name for t in fp.full_dst.model.tensors if t.dtype == "float8_e4m3fn"}
    return shard(fp.full_dst, reference_checkpoint(w, quantized, fp.scheme.block), fill=SENTINEL)  # padding untouched


# --- the scheme --------------------------------------------------------------------------------------------------
def test_scheme_from_hf_config(tmp_path):
    cfg = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme":
                                   "dynamic", "fmt": "e4m3", "modules_to_not_convert": ["lm_head",
                                                                                        "model.layers.0.mlp.gate"]}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    s = Fp8Scheme.from_hf_config(str(tmp_path / "config.json"))
    assert s.block == (128, 128) and s.ignored == ("lm_head", "model.layers.0.mlp.gate")
    assert s.is_ignored("model.layers.0.mlp.gate.weight") and not s.is_ignored("model.layers.1.mlp.gate.weight")
    assert Fp8Scheme.from_quantization_config({**cfg["quantization_config"], "ignored_layers": ["x"]}).ignored == \
        ("x",)  # vLLM reads ignored_layers first
    assert Fp8Scheme(ignored=("model.layers.1.mlp.experts",)).is_ignored("model.layers.1.mlp.experts.3.up_proj.weight")
    for bad, field in [({"quant_method": "awq", "weight_block_size": [128, 128]}, "quant_method"),
                       ({"quant_method": "fp8"}, "weight_block_size"),
                       ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
                       ({"quant_method": "fp8", "weight_block_size": [128, 0]}, "weight_block_size"),
                       ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
                        "activation_scheme")]:
        with pytest.raises(ModelConfigError, match=field):
            Fp8Scheme.from_quantization_config(bad)
    with pytest.raises(ModelConfigError, match="quantization_config"):
        Fp8Scheme.from_hf_config({"model_type": "qwen3"})


def test_engine_config_disagreeing_is_refused():
    s = Fp8Scheme(ignored=("lm_head",))
    s.check_engine({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                            "modules_to_not_convert": ["lm_head"]}})
    with pytest.raises(ModelConfigError, match=r"weight_block_size.*\[64, 64\] blocks.*\[128, 128\]"):
        s.check_engine({"quant_method": "fp8", "weight_block_size": [64, 64], "modules_to_not_convert": ["lm_head"]})
    with pytest.raises(ModelConfigError, match="modules_to_not_convert.*only the engine's: \\['model.layers.0"):
        s.check_engine({"quant_method": "fp8", "weight_block_size": [128, 128],
                        "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"]})
    with pytest.raises(ModelConfigError, match="not an FP8 engine"):
        s.check_engine({"model_type": "qwen3"})


# --- the destination ---------------------------------------------------------------------------------------------
def test_destination_tensors_are_vllm_fp8_parameters():
    """Per rank: fp8 weights shaped as the unquantized ones, float32 weight_scale_inv shaped as vLLM's
    create_fp8_scale_parameter makes them (ceil(sum of output partitions / bn), ceil(input partition / bk)); the
    MoE stacks as Fp8MoEMethod makes them; norms, embeddings, lm_head and ignored modules stay bf16."""
    fp = compile_fp8(M(model=qwen3(), tp=2), V(model=qwen3(), tp=2), Fp8Scheme())
    d = fp.full_dst
    t, dt = d.rank_tensors(1), d.tensor_dtypes()
    L = "model.layers.1."
    assert t[L + "self_attn.qkv_proj.weight"] == (512, 256) and dt[(1, L + "self_attn.qkv_proj.weight")] == \
        "float8_e4m3fn"
    assert t[L + "self_attn.qkv_proj.weight_scale_inv"] == (4, 2)  # (256 + 128 + 128) / 128 rows, 256 / 128
    assert t[L + "self_attn.o_proj.weight_scale_inv"] == (2, 2)  # input partition 512 / 2 = 256
    assert t[L + "mlp.gate_up_proj.weight_scale_inv"] == (4, 2) and t[L + "mlp.down_proj.weight_scale_inv"] == (2, 2)
    for name in ("model.embed_tokens.weight", "lm_head.weight", L + "input_layernorm.weight"):
        assert (1, name) not in dt and name + "_scale_inv" not in t
    moe = compile_fp8(M(model=qwen3_moe(), tp=2, ep=2), V(model=qwen3_moe(), tp=2),
                      Fp8Scheme(ignored=("model.layers.0.mlp.gate", "model.layers.1.mlp.gate"))).full_dst
    t, dt = moe.rank_tensors(0), moe.tensor_dtypes()
    assert t[L + "mlp.experts.routed_experts.w13_weight"] == (4, 256, 256)
    assert t[L + "mlp.experts.routed_experts.w13_weight_scale_inv"] == (4, 2, 2)  # E, 2 * ceil(128/128), ceil(256/128)
    assert t[L + "mlp.experts.routed_experts.w2_weight_scale_inv"] == (4, 2, 1)  # E, ceil(256/128), ceil(128/128)
    assert (0, L + "mlp.gate.weight") not in dt  # ignored: the router stays bf16


def test_vllm_tp_that_splits_a_block_is_refused_naming_tensor_dim_and_block():
    spec = qwen3(intermediate=384)  # 384 / tp 2 = 192 rows per rank: block 1 of dim 0 is cut in two
    with pytest.raises(LayoutError, match=r"gate_proj.weight_scale_inv.*splits 128x128 block 1 of dim 0") as e:
        compile_fp8(M(model=spec), V(model=spec, tp=2), Fp8Scheme())
    assert e.value.values["dim"] == 0 and e.value.values["block"] == 1


# --- where blocks are quantized, and what crosses the wire ----------------------------------------------------------
def test_sender_quantization_halves_the_wire():
    spec = qwen3()
    fp = compile_fp8(M(model=spec, tp=2), V(model=spec, tp=1), Fp8Scheme())
    assert set(fp.where.values()) == {"sender"}
    qnumel = sum(t.numel for t in spec.tensors if t.name in {x.name for x in fp.full_dst.model.tensors
                                                              if x.dtype == "float8_e4m3fn"})
    scales = sum(t.numel * 4 for t in fp.full_dst.model.tensors if t.dtype == "float32")
    assert fp.baseline_bytes == spec.num_bytes  # everything in bf16 once
    assert fp.wire_bytes == spec.num_bytes - qnumel + scales  # fp8: one byte instead of two, plus the scales
    assert fp.quantize_elements[0] == [qnumel // 2, qnumel // 2] and fp.quantize_elements[1] == [0]
    off = compile_fp8(M(model=spec, tp=2), V(model=spec, tp=1), Fp8Scheme(), sender_quantization=False)
    assert off.wire_bytes == off.baseline_bytes == fp.baseline_bytes and off.quantize_elements[1] == [qnumel]


def test_trainer_cut_through_blocks_moves_those_kinds_to_the_receiver():
    spec = qwen3(intermediate=384)  # Megatron tp=2 cuts fc1 / fc2 through blocks; vLLM tp=1 holds them whole
    fp = compile_fp8(M(model=spec, tp=2), V(model=spec, tp=1), Fp8Scheme())
    assert {k.split(".")[-2] for k, v in fp.where.items() if v == "receiver"} == {"gate_proj", "up_proj", "down_proj"}
    assert {k.split(".")[-2] for k, v in fp.where.items() if v == "sender"} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert "splits 128x128 block" in fp.why["model.layers.{i}.mlp.down_proj.weight"]
    assert fp.baseline_bytes > fp.wire_bytes
    summary = fp.summary()
    assert summary["wire_bytes"] == fp.wire_bytes and sum(summary["quantize_elements_by_dst"]) == 2 * 3 * 384 * 256


# --- refits against the reference ---------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["dense tp2 -> tp1", "dense tp1 -> tp2 x2", "mixed: trainer cuts blocks",
                                  "all on receivers", "moe ep2 -> tp2", "hf (loader install)", "hf, mixed",
                                  "ignored modules", "float32 trainer", "float32 trainer, all on receivers"])
def test_refit_equals_reference_checkpoint(case):
    spec, moe = qwen3(), qwen3_moe()
    s, scheme, kw = M(model=spec, tp=2), Fp8Scheme(), {}
    d = V(model=spec, tp=1)
    if case == "dense tp1 -> tp2 x2":
        s, d = M(model=spec), V(model=spec, tp=2, replicas=2)
    elif case == "mixed: trainer cuts blocks":
        s, d = M(model=qwen3(intermediate=384), tp=2), V(model=qwen3(intermediate=384), tp=1)
    elif case == "all on receivers":
        kw = {"sender_quantization": False}
    elif case == "moe ep2 -> tp2":
        s, d = M(model=moe, tp=2, ep=2), V(model=moe, tp=2)
    elif case == "hf (loader install)":
        d = H(model=spec)
    elif case == "hf, mixed":  # receivers quantize into the checkpoint's own names
        s, d = M(model=qwen3(intermediate=384), tp=2), H(model=qwen3(intermediate=384), replicas=2)
    elif case == "ignored modules":  # per layer, under PP: stage 0's layer 0 and stage 1's layer 1 share names
        s = M(model=spec, tp=2, pp=2)
        scheme = Fp8Scheme(ignored=("model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj"))
    elif case.startswith("float32 trainer"):  # the scales share the trainer's dtype: found by name, not by dtype
        spec = qwen3(dtype="float32")
        s, d = M(model=spec, tp=2), V(model=spec, tp=1)
        kw = {"sender_quantization": False} if case.endswith("receivers") else {}
    fp = compile_fp8(s, d, scheme, **kw)
    w = weights(s.model)
    src = shard(s, w)
    dst = allocate(fp.full_dst, SENTINEL)
    execute_fp8_local(fp, src, dst)
    want = expected(fp, w)
    bad = [f"rank {r} {n}" for r in want for n in want[r] if not same_bytes(dst[r][n], want[r][n])]
    assert not bad, bad[:10]
    if case == "ignored modules":
        assert dst[0]["model.layers.0.self_attn.o_proj.weight"].dtype == torch.bfloat16
        assert "model.layers.0.self_attn.o_proj.weight_scale_inv" not in dst[0]


def test_quantizer_equals_reference_on_edge_values():
    """Zero blocks (amax floor), partial edge blocks, values at the fp8 range, subnormals, ties: byte-equal."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(300, 200, generator=g) * 3).to(torch.bfloat16)
    x[:128, :128] = 0
    x[128:256, 128:] = torch.randn(128, 72, generator=g).to(torch.bfloat16) * 1e-30
    x[256:, :64] = torch.tensor([448.0, -448.0, 1.0, 0.5]).repeat(44, 16).to(torch.bfloat16)
    for block in [(128, 128), (32, 64), (1, 200)]:
        q, s = quantize_blocks(x, block)
        rq, rs = reference_quantize(x, block)
        assert same_bytes(q, rq) and same_bytes(s, rs), block


# --- bad input, refused before any byte moves ------------------------------------------------------------------
def _setup():
    spec = qwen3()
    fp = compile_fp8(M(model=spec, tp=2), V(model=spec, tp=1), Fp8Scheme())
    return fp, shard(M(model=spec, tp=2), weights(spec)), allocate(fp.full_dst, SENTINEL)


def test_missing_or_misshapen_scale_is_refused_before_any_byte_moves():
    fp, src, dst = _setup()
    name = "model.layers.1.self_attn.qkv_proj.weight_scale_inv"
    before = {n: t.clone() for n, t in dst[0].items()}
    missing = {0: {n: t for n, t in dst[0].items() if n != name}}
    with pytest.raises(ExecutionError, match=f"no scale '{name}'"):
        Fp8Executor(fp, None, 0, src, missing)
    with pytest.raises(ExecutionError, match=rf"{name}': got \(8, 3\) torch.float32, the FP8 destination "
                       r"declares \(8, 2\) torch.float32 \(128x128 blocks\)"):
        Fp8Executor(fp, None, 0, src, {0: dict(dst[0], **{name: torch.zeros(8, 3)})})
    bf16_weight = {0: dict(dst[0], **{"model.layers.0.mlp.down_proj.weight": torch.zeros(256, 512,
                                                                                         dtype=torch.bfloat16)})}
    with pytest.raises(ExecutionError, match="down_proj.weight': got .* torch.bfloat16, the FP8 destination declares"):
        Fp8Executor(fp, None, 0, src, bf16_weight)
    assert all(same_bytes(before[n], dst[0][n]) for n in before)


def test_source_already_fp8_is_refused():
    fp, src, dst = _setup()
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    src[0][name] = src[0][name].to(torch.float8_e4m3fn)
    with pytest.raises(ExecutionError, match="already in torch.float8_e4m3fn is not re-quantized"):
        Fp8Executor(fp, None, 0, src, dst)
    fp8_spec = reshard.ModelSpec(**{**qwen3().model_dump(), "dtype": "float8_e4m3fn"})
    with pytest.raises(ModelConfigError, match="already float8"):
        compile_fp8(M(model=fp8_spec), V(model=fp8_spec), Fp8Scheme())


def test_a_failed_receiver_quantization_leaves_weights_and_scales_unchanged():
    """The receivers quantize every staging tensor before writing any weight or scale."""
    spec = qwen3(intermediate=384)
    fp = compile_fp8(M(model=spec, tp=2), V(model=spec, tp=1), Fp8Scheme())
    src, dst = shard(M(model=spec, tp=2), weights(spec)), allocate(fp.full_dst, SENTINEL)
    ex = Fp8Executor(fp, None, 0, src, dst)
    receiver_names = {"model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.gate_up_proj.weight_scale_inv"}
    before = {n: dst[0][n].clone() for n in receiver_names}
    calls = {"n": 0}

    def flaky(x, block, out=None):
        calls["n"] += 1
        if calls["n"] > len(ex.senders.jobs) + 2:
            raise RuntimeError("injected")
        return quantize_blocks(x, block, out)

    ex.quantize = flaky
    with pytest.raises(RuntimeError, match="injected"):
        ex.refit()
    assert all(same_bytes(before[n], dst[0][n]) for n in receiver_names)


def test_quantized_entries_follow_vllm_linear_layers():
    names = {n.split(".")[-2] for n in quantized_entries(qwen3_moe(), Fp8Scheme())}
    assert names == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate"}


# --- DeepSeek-V3: MLA projections quantized as its FP8 release does ------------------------------------------------
def deepseek() -> reshard.ModelSpec:
    cfg = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=256,
               intermediate_size=256, moe_intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
               kv_lora_rank=128, q_lora_rank=128, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
               topk_method="noaux_tc", n_group=1, topk_group=1, norm_topk_prob=True, scoring_func="sigmoid",
               first_k_dense_replace=1, moe_layer_freq=1, hidden_act="silu", vocab_size=512,
               tie_word_embeddings=False, torch_dtype="bfloat16")
    return reshard.ModelSpec.from_hf_config(cfg)


def test_deepseek_mla_projections_and_experts_quantized_router_kept():
    spec = deepseek()
    names = {n.replace("model.layers.{i}.", "") for n in quantized_entries(spec, Fp8Scheme())}
    assert names == {"self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
                     "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
                     "mlp.up_proj.weight", "mlp.down_proj.weight", "mlp.experts.{e}.gate_proj.weight",
                     "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight",
                     "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
                     "mlp.shared_experts.down_proj.weight"}  # not mlp.gate (vLLM builds it unquantized)
    fp = compile_fp8(M(model=spec, tp=2, naming="te"), V(model=spec, tp=2), Fp8Scheme())
    t = fp.full_dst.rank_tensors(0)
    L = "model.layers.1."
    # q_a_proj [128, 256] and kv_a_proj_with_mqa [192, 256] stacked whole: 1 + ceil(192 / 128) block rows
    assert t[L + "self_attn.fused_qkv_a_proj.weight_scale_inv"] == (3, 2)
    assert t[L + "self_attn.kv_b_proj.weight_scale_inv"] == (4, 1)  # 4 heads x (128 + 128) / tp 2 rows, 128 cols
    assert t[L + "self_attn.q_b_proj.weight_scale_inv"] == (3, 1)  # 4 heads x (128 + 64) / tp 2 rows
    assert (0, L + "mlp.gate.weight") not in fp.full_dst.tensor_dtypes()
    assert fp.full_dst.tensor_dtype(0, L + "mlp.gate.e_score_correction_bias") == "float32"


@pytest.mark.parametrize("naming", ["local", "te"])
def test_deepseek_refit_equals_reference_checkpoint(naming):
    """Megatron's local MLA spec cuts q_a / kv_a over TP through blocks (those go to the receivers); TE keeps them
    whole (senders)."""
    spec = deepseek()
    s = M(model=spec, tp=2, ep=2, naming=naming)
    fp = compile_fp8(s, V(model=spec, tp=2), Fp8Scheme())
    receivers = {k.split(".")[-2] for k, v in fp.where.items() if v == "receiver"}
    assert receivers == ({"q_a_proj", "kv_a_proj_with_mqa"} if naming == "local" else set())
    w = weights(spec)
    w = {n: t.float() if spec.tensor(n).dtype == "float32" else t for n, t in w.items()}
    dst = allocate(fp.full_dst, SENTINEL)
    execute_fp8_local(fp, shard(s, w), dst)
    want = expected(fp, w)
    bad = [f"rank {r} {n}" for r in want for n in want[r] if not same_bytes(dst[r][n], want[r][n])]
    assert not bad, bad[:10]


def test_cli_plan_fp8_reports_both_wire_sizes(capsys):
    from reshard.cli import main

    args = ["plan", "--model", "examples/configs/qwen3-8b-fp8.json", "--src", "megatron:tp=4,world=8", "--dst",
            "vllm:tp=2,replicas=2", "--fp8"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["fp8"]
    assert out["block"] == [128, 128] and set(out["where"].values()) == {"sender"}
    assert out["wire_bytes"] < 0.6 * out["wire_bytes_without_sender_quantization"]
    assert len(out["quantize_elements_by_src"]) == 8 and sum(out["quantize_elements_by_dst"]) == 0
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "with sender-side quantization" in text and "7 of 7 quantized tensor kinds on the sender" in text
    # an engine config without FP8 blocks: refused in one line
    assert main(["plan", "--model", "examples/configs/qwen3-8b.json", "--src", "megatron:tp=4", "--dst", "vllm:tp=2",
                 "--fp8"]) == 2
    assert "quantization_config" in capsys.readouterr().err
