"""Check a live model (its ModelFacts) before anything moves, and bind it.

`spec_problems` / `spec_from_megatron`: the canonical model behind its config (RMSNorm, SwiGLU, no biases,
rotary; a block the family does not compute is a problem too). `verify`: the config against the spec, the derived
layout against the declared one, this rank's tensors (persistent buffers included) and layer positions against
the layout's, every problem in one LayoutMismatchError (a LoRA adapter's layout: its parameters only).
`source_tensors`: this rank's physical tensors as views of the live parameters (zero copy but for a dtype change,
`cast=True`, or a non-contiguous parameter).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from ...errors import LayoutMismatchError, ModelConfigError
from ...executors.reference import torch_dtype
from ...layouts import MegatronLayout, ModelSpec
from ...layouts.lora import FAMILY as LORA
from ...layouts.registry import families
from .derive import derive_layout
from .model import ConfigFacts, read_model

ADAPTER = ".adapter."  # Megatron-Bridge's adapters: <module>.adapter.linear_in / linear_out
_DTYPES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float32": "float32"}


def _moe_dense_layers(config: Any) -> tuple[int, ...]:
    """Layers without experts, from megatron's moe_layer_freq (an int k: every k-th layer is MoE; or a 0/1 list)."""
    if not config.num_moe_experts:
        return ()
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return tuple(i for i in range(config.num_layers) if i % freq)
    return tuple(i for i, moe in enumerate(freq) if not moe)


def spec_from_megatron(model: Any, *, vocab_size: int | None = None, dtype: str | None = None) -> ModelSpec:
    """A ModelSpec read off a GPTModel chunk or its ModelFacts; `vocab_size`: the true vocabulary (default: padded)."""
    facts = ConfigFacts.of(model)
    cfg = facts.transformer
    moe = bool(cfg.num_moe_experts)
    matches = [f.name for f in families() if f.from_megatron(cfg)]
    if len(matches) != 1:
        raise ModelConfigError(f"the GPTModel's config (qk_layernorm={bool(cfg.qk_layernorm)}, num_moe_experts="
                               f"{cfg.num_moe_experts or 0}) matches {matches or 'no'} families that can be read "
                               f"off a megatron-core config; declare the spec from the HF config instead")
    dtype = dtype or _DTYPES.get(str(cfg.params_dtype))
    if dtype is None:
        raise ModelConfigError(f"params_dtype {cfg.params_dtype} is not one of {sorted(_DTYPES)}")
    return ModelSpec(
        family=matches[0], hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups or cfg.num_attention_heads, head_dim=cfg.kv_channels,
        intermediate_size=cfg.ffn_hidden_size if (not moe or _moe_dense_layers(cfg)) else 0,
        vocab_size=vocab_size or facts.padded_vocab, tie_word_embeddings=facts.tied, qk_norm=bool(cfg.qk_layernorm),
        num_experts=cfg.num_moe_experts or 0, moe_intermediate_size=(cfg.moe_ffn_hidden_size or 0) if moe else 0,
        dense_layers=_moe_dense_layers(cfg), dtype=dtype)


def spec_problems(model: Any, spec: ModelSpec) -> list[str]:
    """Every way the GPTModel's config (a chunk's, or its ModelFacts') disagrees with `spec`."""
    import torch.nn.functional as F

    facts = ConfigFacts.of(model)
    cfg = facts.transformer
    problems = []

    def differ(what: str, got: Any, want: Any) -> None:
        if got != want:
            problems.append(f"{what}: the model has {got}, the spec {spec.family} declares {want}")

    differ("hidden_size", cfg.hidden_size, spec.hidden_size)
    differ("num_layers", cfg.num_layers, spec.num_layers)
    differ("num_attention_heads", cfg.num_attention_heads, spec.num_attention_heads)
    differ("num_query_groups (KV heads)", cfg.num_query_groups or cfg.num_attention_heads, spec.num_key_value_heads)
    arch = dict(spec.arch)
    mla = "kv_lora_rank" in arch
    if mla:  # qk_layernorm = MLA's latent norms (q_a / kv_a layernorm); head sizes are MLA's own
        differ("qk_layernorm (MLA latent norms)", bool(cfg.qk_layernorm), True)
        for field, key in (("q_lora_rank", "q_lora_rank"), ("kv_lora_rank", "kv_lora_rank"),
                           ("qk_head_dim", "qk_nope_head_dim"), ("qk_pos_emb_head_dim", "qk_rope_head_dim"),
                           ("v_head_dim", "v_head_dim")):
            differ(field, getattr(cfg, field, None), arch[key])
    else:
        differ("kv_channels (head_dim)", cfg.kv_channels, spec.head_dim)
        differ("qk_layernorm", bool(cfg.qk_layernorm), spec.qk_norm)
    differ("tied embeddings (share_embeddings_and_output_weights)", facts.tied, spec.tie_word_embeddings)
    differ("num_moe_experts", cfg.num_moe_experts or 0, spec.num_experts)
    if spec.is_moe:
        differ("moe_ffn_hidden_size", cfg.moe_ffn_hidden_size, spec.moe_intermediate_size)
        differ("layers without experts (moe_layer_freq)", _moe_dense_layers(cfg), spec.dense_layers)
        differ("moe_shared_expert_intermediate_size", cfg.moe_shared_expert_intermediate_size or 0,
               arch.get("shared_intermediate_size") or 0)
        differ("moe_router_enable_expert_bias", bool(cfg.moe_router_enable_expert_bias), bool(arch.get("router_bias")))
    if not spec.is_moe or spec.dense_layers:
        differ("ffn_hidden_size", cfg.ffn_hidden_size, spec.intermediate_size)
    if facts.padded_vocab < spec.vocab_size:
        problems.append(f"vocab: the model has {facts.padded_vocab} rows, fewer than the spec's {spec.vocab_size}")
    # The block itself: anything else computes a different function from the same-shaped weights.
    differ("normalization", cfg.normalization, "RMSNorm")
    differ("gated_linear_unit", bool(cfg.gated_linear_unit), True)
    differ("activation_func", getattr(cfg.activation_func, "__name__", cfg.activation_func), F.silu.__name__)
    differ("add_bias_linear", bool(cfg.add_bias_linear), False)
    differ("add_qkv_bias", bool(cfg.add_qkv_bias), False)
    differ("layernorm_zero_centered_gamma (stores gamma - 1)", bool(cfg.layernorm_zero_centered_gamma),
           bool(arch.get("zero_centered_norms")))
    differ("multi_latent_attention", bool(getattr(cfg, "multi_latent_attention", False)), mla)
    differ("position_embedding_type", facts.position_embedding_type, "rope")
    return problems


def layout_problems(derived: MegatronLayout, declared: MegatronLayout) -> list[str]:
    """Every field where the layout derived from the live model differs from the declared one."""
    fields = ("tp", "pp", "ep", "etp", "world", "vpp", "first_stage_layers", "last_stage_layers", "naming",
              "rank_order") + (() if declared.model.family == LORA else ("padded_vocab",))
    return [f"{field}: the model has {getattr(derived, field)}, the declared layout {getattr(declared, field)}"
            for field in fields if getattr(derived, field) != getattr(declared, field)]


def rank_problems(layout: MegatronLayout, rank: int, tensors: Mapping[str, torch.Tensor],
                  cast: bool = False) -> list[str]:
    """Names, shapes and dtypes of one rank's live tensors against the layout's physical tensors of that rank."""
    want = layout.rank_tensors(rank)
    problems = []
    for name, shape in want.items():
        dtype = torch_dtype(layout.tensor_dtype(rank, name))  # the router's float32 expert bias: its own
        t = tensors.get(name)
        if t is None:
            problems.append(f"rank {rank}: {name} {shape} is in the layout but not in the model")
        elif tuple(t.shape) != tuple(shape):
            problems.append(f"rank {rank}: {name} has shape {tuple(t.shape)} in the model, {tuple(shape)} in "
                            "the layout")
        elif t.dtype != dtype and not cast:
            problems.append(f"rank {rank}: {name} is {t.dtype} in the model, {dtype} in the layout (cast=True "
                            "converts it, which copies)")
    return problems + [f"rank {rank}: {name} {tuple(tensors[name].shape)} is in the model but not in the layout "
                       "(a refit would not read it)" for name in tensors.keys() - want.keys()]


def layer_problems(layout: MegatronLayout, rank: int, numbers: Mapping[tuple[int, int], int]) -> list[str]:
    """Each live layer (chunk c, index i) with global number n must be where the layout puts layer n."""
    stage = layout.dense_coords(rank)["pp"]
    problems = []
    for (chunk, index), layer in sorted(numbers.items()):
        if not 0 <= layer < layout.model.num_layers:
            problems.append(f"rank {rank}: chunk {chunk} decoder.layers.{index} is layer {layer}, outside the "
                            f"spec's {layout.model.num_layers} layers")
        elif layout.layer_home(layer) != (stage, chunk, index):
            s, c, i = layout.layer_home(layer)
            problems.append(f"rank {rank}: chunk {chunk} decoder.layers.{index} is layer {layer} in the model; the "
                            f"layout puts layer {layer} at stage {s}, chunk {c}, decoder.layers.{i}")
    return problems


def verify(model: Any, declared: MegatronLayout, *, cast: bool = False) -> MegatronLayout:
    """Derive `model`'s layout, check it and this rank's tensors against `declared` (LayoutMismatchError); return it."""
    facts = read_model(model)
    rank = facts.parallel_state.rank
    derived = derive_layout(facts, declared.model, like=declared)
    differences = layout_problems(derived, declared)
    problems = spec_problems(facts, declared.model) + differences
    if rank < declared.num_ranks:
        placed = declared.rank_tensors(rank)
        ours = (lambda n: ADAPTER in n) if declared.model.family == LORA else (lambda n: True)  # noqa: E731
        mine = {n: t for n, t in facts.tensors.items() if ours(n)}
        unplaced = {n: b for n, b in facts.buffers.items() if n not in placed and ours(n)}
        problems += rank_problems(declared, rank, {n: t for n, t in mine.items() if n not in unplaced}, cast)
        problems += [f"rank {rank}: buffer {n} {tuple(b.shape)} holds model state the layout does not place "
                     "(a refit would drop it)" for n, b in unplaced.items()]
        if not differences:  # otherwise a different pipeline split already says why layers moved
            problems += layer_problems(declared, rank, facts.layers)
    if problems:
        raise LayoutMismatchError("megatron", problems)
    return derived


def source_tensors(model: Any, layout: MegatronLayout, *, cast: bool = False,
                   check: bool = True) -> dict[str, torch.Tensor]:
    """{physical name: view of the live tensor} of this rank of `layout`, first verified with `check` (`verify`)."""
    facts = read_model(model)
    if check:
        verify(facts, layout, cast=cast)
    tensors = facts.tensors  # parameters and placed persistent buffers (the router's expert_bias)
    rank = facts.parallel_state.rank
    # detach: a view (same storage, no autograd history); `to` copies only where the destination dtype differs
    # (allowed by cast=True; the router's float32 expert bias has its own), `contiguous` only where a parameter is not
    return {name: tensors[name].detach().to(torch_dtype(layout.tensor_dtype(rank, name))).contiguous()
            for name in layout.rank_tensors(rank)}
