"""The vLLM destination layout (Qwen3, Qwen3-MoE, Llama model code), declared by its parallel sizes.

Facts this encodes (pinned by tests/unit/test_vllm_layout.py and, against real vLLM, by the vLLM adapter tests):
- qkv_proj per TP rank is [q_r; k_r; v_r]; when tp > num_kv_heads each KV head is replicated on
  tp / num_kv_heads ranks and rank r holds KV head r // (tp / num_kv_heads);
- gate_up_proj is [gate_r; up_r]; o_proj and down_proj are split on dim 1;
- experts (`mlp.experts.routed_experts.*` in vLLM 0.33): w13 [E_local, 2 Fm/tp_moe, H] holding [w1 (gate); w3 (up)] per expert, w2 [E_local, H, Fm/tp_moe];
  without expert parallel every rank holds all experts split on the FFN dim; with it tp_moe = 1 and rank r
  holds experts [r E/tp, (r+1) E/tp);
- vocab rows are padded to a multiple of `vocab_padding` (64) and then split evenly over TP; padding rows are
  not model data and are left alone;
- replicas are independent engines with identical layouts; replica k's rank r is global rank r + k*tp.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from pydantic import model_validator

from .base import Layout, Placement, PlacementTable, TableBuilder, divisible, pad_to, positive, rank_tensor_table
from .kinds import check_kinds
from .model import HF_NAMES, ROLES, Role, role_at, TensorSpec

# vLLM parameter names, per role; `{i}` is the layer. Kept as data so a vLLM version that renames can be
# described in one place (the vLLM adapter checks them against live models).
VLLM_NAMES = {
    **HF_NAMES,  # vLLM keeps the checkpoint's names except where it fuses tensors
    Role.Q: "model.layers.{i}.self_attn.qkv_proj.weight",
    Role.K: "model.layers.{i}.self_attn.qkv_proj.weight",
    Role.V: "model.layers.{i}.self_attn.qkv_proj.weight",
    Role.GATE: "model.layers.{i}.mlp.gate_up_proj.weight",
    Role.UP: "model.layers.{i}.mlp.gate_up_proj.weight",
    Role.EXPERT_GATE: "model.layers.{i}.mlp.experts.routed_experts.w13_weight",
    Role.EXPERT_UP: "model.layers.{i}.mlp.experts.routed_experts.w13_weight",
    Role.EXPERT_DOWN: "model.layers.{i}.mlp.experts.routed_experts.w2_weight",
}


class VllmLayout(Layout):
    kind = "vllm"

    tp: int = 1
    replicas: int = 1
    expert_parallel: bool = False
    vocab_padding: int = 64

    @model_validator(mode="after")
    def _validate(self) -> "VllmLayout":
        m = self.model
        positive(self, tp=self.tp, replicas=self.replicas, vocab_padding=self.vocab_padding)
        divisible(self, "num_attention_heads", m.num_attention_heads, "tp", self.tp)
        g = m.num_key_value_heads
        if self.tp >= g:
            divisible(self, "tp", self.tp, "num_key_value_heads", g)
        else:
            divisible(self, "num_key_value_heads", g, "tp", self.tp)
        if not m.is_moe or m.dense_layers:
            divisible(self, "intermediate_size", m.intermediate_size, "tp", self.tp)
        if m.is_moe:
            if self.expert_parallel:
                divisible(self, "num_experts", m.num_experts, "tp (expert parallel size)", self.tp)
            else:
                divisible(self, "moe_intermediate_size", m.moe_intermediate_size, "tp", self.tp)
        elif self.expert_parallel:
            self._fail(f"expert_parallel=True needs a MoE model; {m.family} has no experts",
                       expert_parallel=True)
        divisible(self, "padded_vocab", self.padded_vocab, "tp", self.tp)
        check_kinds(self.kind, m, self.tp, lambda k: k.vllm)
        return self

    @property
    def num_ranks(self) -> int:
        return self.tp * self.replicas

    @property
    def num_replicas(self) -> int:
        return self.replicas

    @property
    def padded_vocab(self) -> int:
        return pad_to(self.model.vocab_size, self.vocab_padding)

    @property
    def name_prefix(self) -> str:
        """Prepended to every parameter name: a multimodal wrapper nests the language model (e.g.
        `language_model.` for vLLM's Qwen3.5 ForConditionalGeneration); the family sets it in the spec."""
        return self.model.arch_value("vllm_prefix", "")

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.model.num_key_value_heads // self.tp)

    def __str__(self) -> str:
        ep = ",ep" if self.expert_parallel else ""
        return f"vllm:tp={self.tp},replicas={self.replicas}{ep}"

    def rank_tensors(self, rank: int) -> dict[str, tuple[int, ...]]:
        self._check_rank(rank)
        return rank_tensor_table(self).get(rank, {})

    def placements(self, tensor: TensorSpec, replica: int | None = None) -> list[Placement]:
        if tensor.role in _HANDLERS:
            local = _HANDLERS[tensor.role](self, tensor, VLLM_NAMES[tensor.role].format(i=tensor.layer))
        else:  # a family-specific kind (layouts/kinds.py) places itself
            local = tensor.role.vllm_placements(self, tensor)
        if self.name_prefix:
            local = [p._replace(tensor=self.name_prefix + p.tensor) for p in local]
        if replica == 0:
            return local
        replicas = range(self.replicas) if replica is None else (replica,)
        return [p._replace(rank=p.rank + k * self.tp) for k in replicas for p in local]


    def placement_table(self, index: np.ndarray | Sequence[int] | None = None,
                        replica: int | None = None) -> PlacementTable:
        return _vllm_table(self, index, replica)


# --- one placement rule per role, for replica 0 -----------------------------------------------------

def _vocab(lay: VllmLayout, t: TensorSpec, name: str) -> list[Placement]:
    V, H = t.shape
    rows = lay.padded_vocab // lay.tp
    out = []
    for r in range(lay.tp):
        lo, hi = r * rows, min((r + 1) * rows, V)
        out.append(Placement(r, name, (rows, H), (min(lo, V), 0), (max(hi - lo, 0), H), (0, 0)))
    return out


def _replicated(lay: VllmLayout, t: TensorSpec, name: str) -> list[Placement]:
    zero = (0,) * len(t.shape)
    return [Placement(r, name, t.shape, zero, t.shape, zero) for r in range(lay.tp)]


def _qkv(lay: VllmLayout, t: TensorSpec, name: str) -> list[Placement]:
    m = lay.model
    d, H, g, tp = m.head_dim, m.hidden_size, m.num_key_value_heads, lay.tp
    q_rows = m.num_attention_heads // tp * d
    kv_local = lay.kv_heads_per_rank
    shape = (q_rows + 2 * kv_local * d, H)
    out = []
    for r in range(tp):
        if t.role == Role.Q:
            out.append(Placement(r, name, shape, (r * q_rows, 0), (q_rows, H), (0, 0)))
            continue
        first_head = r * kv_local if tp <= g else r // (tp // g)
        phys_row = q_rows if t.role == Role.K else q_rows + kv_local * d
        out.append(Placement(r, name, shape, (first_head * d, 0), (kv_local * d, H), (phys_row, 0)))
    return out


def _row_split(lay: VllmLayout, t: TensorSpec, name: str) -> list[Placement]:
    rows, cols = t.shape
    per = cols // lay.tp
    return [Placement(r, name, (rows, per), (0, r * per), (rows, per), (0, 0)) for r in range(lay.tp)]


def _gate_up(lay: VllmLayout, t: TensorSpec, name: str) -> list[Placement]:
    F, H = t.shape
    per = F // lay.tp
    phys_row = 0 if t.role == Role.GATE else per
    return [Placement(r, name, (2 * per, H), (r * per, 0), (per, H), (phys_row, 0)) for r in range(lay.tp)]


def _expert(lay: VllmLayout, t: TensorSpec, name: str) -> list[Placement]:
    m = lay.model
    Fm, H, E = m.moe_intermediate_size, m.hidden_size, m.num_experts
    if lay.expert_parallel:
        per_rank = E // lay.tp
        ranks, slot, split = [t.expert // per_rank], t.expert % per_rank, 1
        e_local = per_rank
    else:
        ranks, slot, split, e_local = list(range(lay.tp)), t.expert, lay.tp, E
    per = Fm // split
    out = []
    for r in ranks:
        tp_r = r if split > 1 else 0
        if t.role == Role.EXPERT_DOWN:
            out.append(Placement(r, name, (e_local, H, per), (0, tp_r * per), (H, per), (slot, 0, 0)))
        else:
            row = 0 if t.role == Role.EXPERT_GATE else per
            out.append(Placement(r, name, (e_local, 2 * per, H), (tp_r * per, 0), (per, H), (slot, row, 0)))
    return out


_HANDLERS = {
    Role.EMBED: _vocab,
    Role.LM_HEAD: _vocab,
    Role.FINAL_NORM: _replicated,
    Role.INPUT_NORM: _replicated,
    Role.POST_ATTN_NORM: _replicated,
    Role.Q_NORM: _replicated,
    Role.K_NORM: _replicated,
    Role.Q: _qkv,
    Role.K: _qkv,
    Role.V: _qkv,
    Role.O: _row_split,
    Role.GATE: _gate_up,
    Role.UP: _gate_up,
    Role.DOWN: _row_split,
    Role.ROUTER: _replicated,
    Role.EXPERT_GATE: _expert,
    Role.EXPERT_UP: _expert,
    Role.EXPERT_DOWN: _expert,
}


# --- the same rules, batched: one numpy expression per role over every layer and expert ----------------

def _vllm_table(lay: VllmLayout, index, replica: int | None) -> PlacementTable:
    """Rows laid out as (tensor, replica, rank in replica); mirrors the per-role rules above."""
    spec = lay.model
    c = spec.canonical
    index = np.arange(len(c), dtype=np.int64) if index is None else np.asarray(index, dtype=np.int64)
    shift = (np.arange(lay.replicas) if replica is None else np.asarray([replica])) * lay.tp
    b = TableBuilder()
    m = spec
    d, H, g, tp = m.head_dim, m.hidden_size, m.num_key_value_heads, lay.tp
    R = np.arange(tp)[None, None, :]
    K = shift[None, :, None]
    roles = c.role[index]
    for code in np.flatnonzero(np.bincount(roles)).tolist():
        idx = index[roles == code]
        role = role_at(code)
        if c.layer[idx[0]] < 0 or not isinstance(role, Role):  # embeddings, final norm, lm_head; family kinds
            for k in idx.tolist():
                b.add_placements(k, lay.placements(spec.tensor_at(k), replica))
            continue
        rows, cols = int(c.rows[idx[0]]), int(c.cols[idx[0]])
        T = idx[:, None, None]
        fmt = lay.name_prefix + VLLM_NAMES[role]
        layer_keys = c.layer[idx]

        def kinds(shape):
            return b.kinds_for(layer_keys, lambda i: fmt.format(i=i), shape)[:, None, None]

        if role in (Role.INPUT_NORM, Role.POST_ATTN_NORM, Role.Q_NORM, Role.K_NORM, Role.ROUTER):
            shape = (rows, cols) if c.ndim[idx[0]] == 2 else (cols,)
            b.add(T, R + K, kinds(shape), 0, 0, rows, cols, 0, cols)
        elif role in (Role.Q, Role.K, Role.V):
            q_rows = m.num_attention_heads // tp * d
            kv_local = lay.kv_heads_per_rank
            kind = kinds((q_rows + 2 * kv_local * d, H))
            if role == Role.Q:
                b.add(T, R + K, kind, R * q_rows, 0, q_rows, H, 0, H)
            else:
                first = R * kv_local if tp <= g else R // (tp // g)
                phys_row = q_rows if role == Role.K else q_rows + kv_local * d
                b.add(T, R + K, kind, first * d, 0, kv_local * d, H, phys_row * H, H)
        elif role in (Role.O, Role.DOWN):
            per = cols // tp
            b.add(T, R + K, kinds((rows, per)), 0, R * per, rows, per, 0, per)
        elif role in (Role.GATE, Role.UP):
            per = rows // tp
            b.add(T, R + K, kinds((2 * per, cols)), R * per, 0, per, cols, (0 if role == Role.GATE else per) * cols, cols)
        elif role.is_expert:
            Fm, E = m.moe_intermediate_size, m.num_experts
            e = c.expert[idx][:, None, None]
            if lay.expert_parallel:
                per_rank = E // tp
                rank, slot, split, e_local = e // per_rank, e % per_rank, 1, per_rank
                tp_r = 0
            else:
                rank, slot, split, e_local = R, e, tp, E
                tp_r = R
            per = Fm // split
            if role == Role.EXPERT_DOWN:
                b.add(T, rank + K, kinds((e_local, H, per)), 0, tp_r * per, H, per, slot * H * per, per)
            else:
                row = 0 if role == Role.EXPERT_GATE else per
                b.add(T, rank + K, kinds((e_local, 2 * per, H)), tp_r * per, 0, per, H, (slot * 2 * per + row) * H, H)
        else:  # pragma: no cover - every layer role has a rule above
            for k in idx.tolist():
                b.add_placements(k, lay.placements(spec.tensor_at(k), replica))
    return b.table()
