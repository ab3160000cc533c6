"""The shared roles (embed, norms, q/k/v, o, gate/up/down, router, experts) as `TensorKind`s of the built-in engines.

Megatron: linear_qkv interleaves rows per query group ([q heads; k; v]), cut into contiguous TP row blocks;
linear_fc1 holds [gate_r; up_r]; linear_proj and linear_fc2 are column blocks; experts alike over expert TP.
vLLM: qkv_proj holds [q_r; k_r; v_r] (a KV head replicated when tp > kv heads), gate_up_proj [gate_r; up_r],
o_proj and down_proj column blocks; experts stacked: w13 [E_local, 2 Fm/tp, H], w2 [E_local, H, Fm/tp]."""
from __future__ import annotations

import functools
from types import MappingProxyType
from typing import Any, Callable, Hashable, Mapping

from .cuts import ColumnBlocks, Cut, GlobalRows, QkvParallel, Replicated, RowBlocks, TensorKind, Vocab
from .model import LAYER, ModelSpec, Role


Cuts = Cut | tuple[Cut, ...]


def tensor_kind(label: str, megatron: Cuts, vllm: Cuts, te: Cuts | None = None, **flags: Any) -> TensorKind:
    """A kind of tensor on the built-in engines: Megatron ("te": TE naming, where it differs) and vLLM cuts."""
    return TensorKind(label, {"megatron": megatron, "te": megatron if te is None else te, "vllm": vllm}, **flags)


def gated_mlp(megatron: str, vllm: str, label: str = "") -> tuple[TensorKind, TensorKind, TensorKind]:
    """gate / up / down of a SwiGLU MLP under the module names `megatron` and `vllm`."""
    fc1, gate_up = megatron + "linear_fc1.weight", vllm + "gate_up_proj.weight"
    return (tensor_kind(label + "gate", RowBlocks(fc1, 0, 2), RowBlocks(gate_up, 0, 2), linear=True),
            tensor_kind(label + "up", RowBlocks(fc1, 1, 2), RowBlocks(gate_up, 1, 2), linear=True),
            tensor_kind(label + "down", ColumnBlocks(megatron + "linear_fc2.weight"),
                        ColumnBlocks(vllm + "down_proj.weight"), linear=True))


def kind_of(spec: ModelSpec, role: Hashable) -> TensorKind:
    """The TensorKind of a tensor's role: a family's own kind is its role; a shared Role's depends on the spec."""
    return role if isinstance(role, TensorKind) else shared_kinds(spec.num_attention_heads, spec.num_key_value_heads,
                                                            spec.head_dim, spec.tie_word_embeddings)[role]


@functools.lru_cache(maxsize=64)
def qkv_kinds(heads: int, groups: int, head_dim: int, gated: bool = False,
              labels: tuple[str, str, str] = ("q", "k", "v")) -> tuple[TensorKind, TensorKind, TensorKind]:
    """q / k / v in Megatron's linear_qkv (per query group [q heads; k; v]) and vLLM's qkv_proj; `gated`: the q
    rows hold [q_h; gate_h] per head (Qwen3.5's output gate) and a linear_qkv group [q heads; gate heads; k; v]."""
    d, hpg = head_dim, heads // groups
    q = (1 + gated) * hpg * d  # query rows of one group
    group = q + 2 * d  # rows of one query group in linear_qkv
    if gated:
        q_blocks = tuple(b for h in range(heads) for b in (
            (2 * h * d, h // hpg * group + h % hpg * d, d),                   # q_h
            ((2 * h + 1) * d, h // hpg * group + (hpg + h % hpg) * d, d)))    # gate_h
    else:
        q_blocks = tuple((g * q, g * group, q) for g in range(groups))
    blocks = (q_blocks, *(tuple((g * d, g * group + q + k * d, d) for g in range(groups)) for k in (0, 1)))
    return tuple(tensor_kind(label, GlobalRows("self_attention.linear_qkv.weight", groups * group, b),
                             QkvParallel(LAYER + "self_attn.qkv_proj.weight", (1 + gated) * heads * d, groups, d, part))
                 for part, (label, b) in enumerate(zip(labels, blocks)))


@functools.lru_cache(maxsize=64)
def shared_kinds(heads: int, groups: int, head_dim: int, tied: bool) -> Mapping[Role, TensorKind]:
    """Each shared role's TensorKind for these attention sizes and tied or untied embeddings."""
    def norm(role: Role, megatron: str, vllm: str, te: str | None = None, moe: str | None = None) -> TensorKind:
        return tensor_kind(role.value, Replicated(megatron), Replicated(LAYER + vllm),
                           te=Replicated(te, moe_name=moe) if te else None)

    def expert(role: Role, fc: str, w: str, cut: Callable[[str], Cut]) -> TensorKind:
        """A routed expert's tensor: Megatron's per-local-expert `{j}` fc1 / fc2, vLLM's stacked w13 / w2."""
        return tensor_kind(role.value, cut(f"mlp.experts.local_experts.{{j}}.linear_{fc}.weight"),
                           cut(f"{LAYER}mlp.experts.routed_experts.{w}_weight"),
                           te=cut(f"mlp.experts.linear_{fc}.weight{{j}}"), expert=True)

    embed = (Vocab("embedding.word_embeddings.weight", at="first"),)
    if tied:  # the last stage keeps a synchronized copy as output_layer.weight (pp > 1)
        embed += (Vocab("output_layer.weight", at="last_copy"),)
    return MappingProxyType({
        Role.EMBED: tensor_kind("embed", embed, Vocab("model.embed_tokens.weight")),
        Role.LM_HEAD: tensor_kind("lm_head", Vocab("output_layer.weight", at="last"), Vocab("lm_head.weight")),
        Role.FINAL_NORM: tensor_kind("final_norm", Replicated("decoder.final_layernorm.weight", at="last"),
                                     Replicated("model.norm.weight")),
        Role.INPUT_NORM: norm(Role.INPUT_NORM, "input_layernorm.weight", "input_layernorm.weight",
                              "self_attention.linear_qkv.layer_norm_weight"),
        Role.POST_ATTN_NORM: norm(Role.POST_ATTN_NORM, "pre_mlp_layernorm.weight", "post_attention_layernorm.weight",
                                  "mlp.linear_fc1.layer_norm_weight", moe="pre_mlp_layernorm.weight"),
        Role.Q_NORM: norm(Role.Q_NORM, "self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
        Role.K_NORM: norm(Role.K_NORM, "self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
        **dict(zip((Role.Q, Role.K, Role.V), qkv_kinds(heads, groups, head_dim))),
        Role.O: tensor_kind("o", ColumnBlocks("self_attention.linear_proj.weight"),
                            ColumnBlocks(LAYER + "self_attn.o_proj.weight")),
        **dict(zip((Role.GATE, Role.UP, Role.DOWN), gated_mlp("mlp.", LAYER + "mlp."))),
        Role.ROUTER: tensor_kind("router", Replicated("mlp.router.weight"), Replicated(LAYER + "mlp.gate.weight")),
        Role.EXPERT_GATE: expert(Role.EXPERT_GATE, "fc1", "w13", lambda name: RowBlocks(name, 0, 2)),
        Role.EXPERT_UP: expert(Role.EXPERT_UP, "fc1", "w13", lambda name: RowBlocks(name, 1, 2)),
        Role.EXPERT_DOWN: expert(Role.EXPERT_DOWN, "fc2", "w2", ColumnBlocks),
    })
