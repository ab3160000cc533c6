"""The pure parts of the Megatron source adapter: naming detection, vocabulary padding, deriving a layout from
process-group facts, the checks' messages, and deriving, checking and binding from ModelFacts alone (a live
model is read once). No megatron-core needed; tests/integration/megatron runs the same code on live models."""
from __future__ import annotations

from collections import Counter
from dataclasses import FrozenInstanceError, replace
from types import SimpleNamespace

import pytest
import torch

import reshard
from reshard.adapters.megatron import (ConfigFacts, ModelFacts, ParallelState, derive_layout, layer_problems,
                                       layout_from_facts, layout_problems, naming_of, rank_problems, read_model,
                                       source_tensors, spec_from_megatron, verify, vocab_divisor)
from reshard.executors import allocate

MOE = reshard.ModelSpec(family="qwen3_moe", hidden_size=8, num_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=2, intermediate_size=12, vocab_size=120, qk_norm=True,
                        num_experts=4, moe_intermediate_size=6, dense_layers=(0,), dtype="float32")
DENSE = reshard.ModelSpec(family="qwen3", hidden_size=8, num_layers=4, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=2, intermediate_size=12, vocab_size=120, qk_norm=True, dtype="float32")


def test_te_layout_names_follow_transformer_engine_spec():
    """TE spec facts (megatron-core 0.19 gpt_layer_specs + TE GroupedLinear): norms fused into linear_qkv and, in
    dense layers, linear_fc1; MoE layers keep pre_mlp_layernorm; grouped experts are weight{j}."""
    names = set(reshard.MegatronLayout(model=MOE, ep=2, naming="te").rank_tensors(0))
    L0, L1 = "decoder.layers.0.", "decoder.layers.1."
    assert {L0 + "self_attention.linear_qkv.layer_norm_weight", L0 + "mlp.linear_fc1.layer_norm_weight",
            L0 + "mlp.linear_fc1.weight", L0 + "mlp.linear_fc2.weight"} <= names
    assert {L1 + "self_attention.linear_qkv.layer_norm_weight", L1 + "pre_mlp_layernorm.weight",
            L1 + "mlp.router.weight", L1 + "mlp.experts.linear_fc1.weight0", L1 + "mlp.experts.linear_fc1.weight1",
            L1 + "mlp.experts.linear_fc2.weight1"} <= names
    assert not any("input_layernorm" in n or "local_experts" in n or n.endswith("weight2") for n in names)
    local = set(reshard.MegatronLayout(model=MOE, ep=2).rank_tensors(0))
    assert {L0 + "input_layernorm.weight", L0 + "pre_mlp_layernorm.weight", L1 + "pre_mlp_layernorm.weight",
            L1 + "mlp.experts.local_experts.1.linear_fc1.weight"} <= local
    assert len(local) == len(names)


def test_naming_detected_from_parameter_names():
    te = reshard.MegatronLayout(model=MOE, naming="te").rank_tensors(0)
    local = reshard.MegatronLayout(model=MOE).rank_tensors(0)
    assert naming_of(te) == "te" and naming_of(local) == "local"
    with pytest.raises(reshard.LayoutError, match="both"):
        naming_of([*te, *local])
    with pytest.raises(reshard.LayoutError, match="neither"):
        naming_of(["embedding.word_embeddings.weight"])
    sequential_te = [*(n for n in te if ".experts." not in n),
                     "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"]
    with pytest.raises(reshard.LayoutError, match="moe_grouped_gemm=True"):
        naming_of(sequential_te)
    with pytest.raises(reshard.LayoutError, match="weight1"):
        naming_of([*local, "decoder.layers.1.mlp.experts.weight1"])  # legacy fused GroupedMLP


@pytest.mark.parametrize("vocab,padded,tp,like,want", [
    (120, 128, 2, None, 8), (120, 128, 2, 64, 64), (120, 128, 1, None, 128), (151936, 152064, 2, None, 128),
    (151936, 151936, 2, None, 1), (100, 100, 2, None, 1), (129, 1024, 8, None, 128)])
def test_vocab_divisor_reproduces_the_padded_size(vocab, padded, tp, like, want):
    """The declared divisor if it fits, else Megatron-LM's 128, else the smallest that reproduces the size."""
    prefer = reshard.MegatronLayout(model=DENSE, vocab_divisor=like) if like else None
    d = vocab_divisor(vocab, padded, tp, prefer)
    assert d == want and -(-vocab // (d * tp)) * d * tp == padded


@pytest.mark.parametrize("padded", [100, 129])
def test_vocab_padding_that_no_divisor_explains_is_refused(padded):
    with pytest.raises(reshard.LayoutError, match=f"vocabulary of {padded} rows"):
        vocab_divisor(120, padded, 2)


def _parallel_state(rank, world, **groups):
    groups = {k: tuple(v) for k, v in groups.items()}
    for axis in ("ep", "etp", "edp"):
        groups.setdefault(axis, (rank,))
    return ParallelState(rank=rank, world=world, groups=groups)


def test_layout_from_facts_default_order():
    """World 8, TP2 x PP2 x DP2, EP2 with expert-TP1, rank 5 (hand-computed from megatron's formulas:
    dense r = tp + 2 dp + 4 pp, expert r = ep + 2 edp + 4 pp)."""
    parallel = _parallel_state(5, 8, tp=[4, 5], dp=[5, 7], pp=[1, 5], ep=[4, 5], etp=[5], edp=[5, 7])
    names = reshard.MegatronLayout(model=MOE, naming="te").rank_tensors(0)
    got = layout_from_facts(MOE, parallel, names=names, vpp=1, padded_vocab=128)
    assert got == reshard.MegatronLayout(model=MOE, tp=2, pp=2, ep=2, etp=1, world=8, naming="te", vocab_divisor=8)


def test_layout_from_facts_finds_another_rank_order():
    """order 'tp-pp-dp': r = tp + 2 pp + 4 dp. Rank 5 has tp 1, pp 0, dp 1."""
    parallel = _parallel_state(5, 8, tp=[4, 5], dp=[1, 5], pp=[5, 7])
    names = reshard.MegatronLayout(model=DENSE).rank_tensors(0)
    got = layout_from_facts(DENSE, parallel, names=names, vpp=1, padded_vocab=128)
    assert [got.dense_coords(r) for r in range(8)] == [
        {"tp": r % 2, "pp": (r // 2) % 2, "dp": r // 4, "cp": 0, "ep": 0} for r in range(8)]
    declared = reshard.MegatronLayout(model=DENSE, tp=2, pp=2, world=8, vocab_divisor=64)
    assert "rank_order: the model has" in layout_problems(got, declared)[0]
    assert layout_problems(layout_from_facts(DENSE, parallel, names=names, vpp=1, padded_vocab=128,
                                             like=declared.model_copy(update={"rank_order": "tp-cp-ep-pp-dp"})),
                           declared.model_copy(update={"rank_order": "tp-cp-ep-pp-dp"})) == []


def test_rank_problems_name_the_tensor_and_both_shapes():
    layout = reshard.MegatronLayout(model=MOE, tp=2, naming="te")
    tensors = allocate(layout, ranks=[1])[1]
    assert rank_problems(layout, 1, tensors) == []
    qkv = "decoder.layers.2.self_attention.linear_qkv.weight"
    bad = dict(tensors)
    bad[qkv] = torch.zeros(7, 8)
    bad["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"] = torch.zeros(4, 8)
    del bad["decoder.final_layernorm.weight"]
    bad["decoder.layers.0.mlp.linear_fc2.weight"] = bad["decoder.layers.0.mlp.linear_fc2.weight"].bfloat16()
    problems = rank_problems(layout, 1, bad)
    assert f"rank 1: {qkv} has shape (7, 8) in the model, (8, 8) in the layout" in problems
    assert any("shared_experts.linear_fc1.weight (4, 8) is in the model but not in the layout" in p for p in problems)
    assert any("decoder.final_layernorm.weight (8,) is in the layout but not in the model" in p for p in problems)
    assert any("linear_fc2.weight is torch.bfloat16 in the model" in p for p in problems)
    assert len(problems) == 4
    assert len(rank_problems(layout, 1, bad, cast=True)) == 3


def test_layer_problems_compare_global_layer_numbers():
    layout = reshard.MegatronLayout(model=DENSE, pp=2, vpp=2)  # one layer per chunk: stage 0 has layers 0, 2
    assert layer_problems(layout, 0, {(0, 0): 0, (1, 0): 2}) == []
    problems = layer_problems(layout, 0, {(0, 0): 0, (1, 0): 1})
    assert problems == ["rank 0: chunk 1 decoder.layers.0 is layer 1 in the model; the layout puts layer 1 at "
                        "stage 1, chunk 0, decoder.layers.0"]


def test_state_buffers_are_persistent_buffers_only():
    """The router's expert_bias is persistent model state (a refit would drop it); token counters are scratch."""
    from reshard.adapters.megatron.model import state_buffers

    router = torch.nn.Module()
    router.register_buffer("expert_bias", torch.zeros(4))
    router.register_buffer("local_tokens_per_expert", torch.zeros(4), persistent=False)
    chunk = torch.nn.Module()
    chunk.router = router
    assert list(state_buffers(chunk)) == ["router.expert_bias"]
    assert list(state_buffers(chunk, "model1.")) == ["model1.router.expert_bias"]


# --- ModelFacts: one read of the model, then pure functions ----------------------------------------------------

TP2 = reshard.MegatronLayout(model=DENSE, tp=2, world=2, vocab_divisor=64)  # 128 vocabulary rows


def _config(**changes):
    """The TransformerConfig fields the checks read, for DENSE."""
    fields = dict(hidden_size=8, num_layers=4, num_attention_heads=4, num_query_groups=2, kv_channels=2,
                  qk_layernorm=True, num_moe_experts=None, ffn_hidden_size=12, normalization="RMSNorm",
                  gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
                  add_qkv_bias=False, layernorm_zero_centered_gamma=False, multi_latent_attention=False,
                  params_dtype=torch.float32, num_layers_in_first_pipeline_stage=None,
                  num_layers_in_last_pipeline_stage=None)
    return SimpleNamespace(**{**fields, **changes})


def _facts(rank: int = 1) -> ModelFacts:
    """Rank `rank` of TP2 as a live model would read: its tensors, layers 0-3 in order, world 2 of two TP ranks."""
    return ModelFacts(parallel_state=_parallel_state(rank, 2, tp=[0, 1], dp=[rank], pp=[rank]),
                      parameters=allocate(TP2, ranks=[rank])[rank], buffers={},
                      layers={(0, i): i for i in range(4)}, vpp=1,
                      config=ConfigFacts(_config(), TP2.padded_vocab, False, "rope"))


def test_layout_checks_and_binding_are_functions_of_the_facts():
    facts = _facts()
    assert derive_layout(facts, DENSE, like=TP2) == verify(facts, TP2) == TP2
    assert spec_from_megatron(facts, vocab_size=120) == DENSE
    src = source_tensors(facts, TP2)
    assert src.keys() == facts.parameters.keys()
    assert all(src[n].data_ptr() == t.data_ptr() for n, t in facts.parameters.items())  # views, not copies
    with pytest.raises(FrozenInstanceError):
        facts.vpp = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        facts.parameters["x"] = torch.zeros(1)  # type: ignore[index]

    qkv = "decoder.layers.2.self_attention.linear_qkv.weight"
    bias = "decoder.layers.0.mlp.router.expert_bias"
    bad = replace(facts, parameters={**facts.parameters, qkv: torch.zeros(7, 8)}, buffers={bias: torch.zeros(4)},
                  layers={**facts.layers, (0, 0): 1}, config=replace(facts.config, transformer=_config(
                      ffn_hidden_size=16)))
    with pytest.raises(reshard.LayoutMismatchError) as err:
        source_tensors(bad, TP2)
    assert err.value.problems == (
        "ffn_hidden_size: the model has 16, the spec qwen3 declares 12",
        f"rank 1: {qkv} has shape (7, 8) in the model, (8, 8) in the layout",
        f"rank 1: buffer {bias} (4,) holds model state the layout does not place (a refit would drop it)",
        "rank 1: chunk 0 decoder.layers.0 is layer 1 in the model; the layout puts layer 1 at stage 0, chunk 0, "
        "decoder.layers.1")


_READS = ("named_parameters", "named_modules", "named_buffers", "state_dict", "decoder", "config", "vocab_size",
          "share_embeddings_and_output_weights", "pg_collection")


class _CountingChunk(torch.nn.Module):
    """A stand-in GPTModel chunk that counts each read of the attributes a reader of the model would use."""

    def __getattribute__(self, name: str):
        reads = object.__getattribute__(self, "__dict__").get("reads")
        if reads is not None and name in _READS:
            reads[name] += 1
        return super().__getattribute__(name)


def _chunk(tensors: dict[str, torch.Tensor]) -> _CountingChunk:
    chunk = _CountingChunk()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        module: torch.nn.Module = chunk
        for part in path:
            if part not in module._modules:
                module.add_module(part, torch.nn.ModuleList() if part == "layers" else torch.nn.Module())
            module = module._modules[part]
        module.register_parameter(leaf, torch.nn.Parameter(t))
    for i, layer in enumerate(chunk.decoder.layers):
        layer.layer_number = i + 1
    chunk.config, chunk.vocab_size, chunk.share_embeddings_and_output_weights = _config(), TP2.padded_vocab, False
    chunk.reads = Counter()
    return chunk


def test_source_tensors_reads_the_model_once(monkeypatch):
    """Deriving, checking and binding (source_tensors) read the model exactly as much as one read_model does;
    given the facts, they do not read it at all. megatron's unwrapping and process groups are stood in for."""
    from reshard.adapters.megatron import model as reader

    calls = Counter()

    def unwrap(model):
        calls["unwrap"] += 1
        return [model]

    def read_parallel_state(chunks):
        calls["read_parallel_state"] += 1
        return _facts().parallel_state

    monkeypatch.setattr(reader, "unwrap", unwrap)
    monkeypatch.setattr(reader, "read_parallel_state", read_parallel_state)
    chunk = _chunk(allocate(TP2, ranks=[1])[1])

    facts = read_model(chunk)
    one_read = chunk.reads + calls
    assert chunk.reads["named_parameters"] == chunk.reads["decoder"] == calls["unwrap"] == 1, one_read
    chunk.reads.clear()
    calls.clear()
    src = source_tensors(chunk, TP2)  # reads, derives, checks, binds
    assert chunk.reads + calls == one_read
    assert all(src[n].data_ptr() == p.data_ptr() for n, p in chunk.named_parameters())

    chunk.reads.clear()
    calls.clear()
    assert derive_layout(facts, DENSE, like=TP2) == verify(facts, TP2) == TP2
    assert source_tensors(facts, TP2).keys() == src.keys()
    assert not chunk.reads and not calls
