"""The Megatron-core source layout (GPT / Qwen3 / Llama models), declared by its parallel sizes.

Facts this encodes (pinned by tests/unit/test_megatron_layout.py and, against real megatron-core, by the
Megatron adapter tests):
- linear_qkv rows are interleaved per query group: [q(hpg heads); k; v] for each group, split into contiguous
  row blocks over TP (whole groups when query groups >= tp; megatron-core 0.19 also accepts fewer groups);
- linear_fc1 is per TP rank [gate_r; up_r]; linear_proj and linear_fc2 are split on dim 1;
- experts: EP rank r holds global experts [r E/ep, (r+1) E/ep), split over the expert-TP group;
- vocab rows are padded to a multiple of `vocab_divisor * tp` (Megatron-LM's make_vocab_size_divisible_by);
- norms and the router are replicated across TP; every tensor is replicated across data parallel ranks;
- global ranks follow megatron-core's RankGenerator for `rank_order` (default 'tp-cp-ep-dp-pp', first fastest).
"""
from __future__ import annotations

import functools
from typing import Literal, Sequence

import numpy as np
from pydantic import Field, model_validator

from .base import Layout, Placement, PlacementTable, TableBuilder, divisible, pad_to, positive, rank_tensor_table
from .kinds import check_kinds
from .model import ROLE_CODE, ROLES, Role, TensorSpec

_AXES = ("tp", "cp", "ep", "dp", "pp")


class MegatronLayout(Layout):
    kind = "megatron"

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = Field(default=None, description="expert tensor parallel size; None means tp (megatron-core's default)")
    world: int | None = Field(default=None, description="world size; None means the smallest that fits")
    vpp: int = Field(default=1, description="virtual pipeline chunks per stage")
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    vocab_divisor: int = 128
    naming: Literal["local", "te"] = "local"
    rank_order: str = "tp-cp-ep-dp-pp"

    @model_validator(mode="before")
    @classmethod
    def _fill_defaults(cls, data: dict) -> dict:
        if isinstance(data, dict):
            data = dict(data)
            tp, pp, ep = data.get("tp", 1), data.get("pp", 1), data.get("ep", 1)
            if data.get("etp") is None:
                data["etp"] = tp
            if data.get("world") is None:
                dense, expert = tp * pp, data["etp"] * ep * pp
                data["world"] = dense * expert // _gcd(dense, expert) if dense > 0 and expert > 0 else 1
        return data

    @model_validator(mode="after")
    def _validate(self) -> "MegatronLayout":
        m = self.model
        positive(self, tp=self.tp, pp=self.pp, ep=self.ep, etp=self.etp, world=self.world, vpp=self.vpp,
                 vocab_divisor=self.vocab_divisor)
        divisible(self, "world", self.world, "tp*pp", self.tp * self.pp)
        divisible(self, "num_attention_heads", m.num_attention_heads, "tp", self.tp)
        qkv_rows = (m.num_attention_heads + 2 * m.num_key_value_heads) * m.head_dim
        divisible(self, "linear_qkv rows (heads + 2 * query_groups) * head_dim", qkv_rows, "tp", self.tp)
        if not m.is_moe or m.dense_layers:
            divisible(self, "ffn_hidden_size", m.intermediate_size, "tp", self.tp)
        if m.is_moe:
            divisible(self, "world", self.world, "etp*ep*pp", self.etp * self.ep * self.pp)
            divisible(self, "num_experts", m.num_experts, "ep", self.ep)
            divisible(self, "moe_ffn_hidden_size", m.moe_intermediate_size, "etp", self.etp)
        elif self.ep != 1 or self.etp != self.tp:
            self._fail(f"ep={self.ep}, etp={self.etp} need a MoE model; {m.family} has no experts",
                       fix="leave ep and etp unset for dense models", ep=self.ep, etp=self.etp)
        axes = self.rank_order.split("-")
        if sorted(axes) != sorted(_AXES):
            self._fail(f"rank_order={self.rank_order!r} must order each of {'-'.join(_AXES)} exactly once",
                       rank_order=self.rank_order)
        self._stage_layer_counts  # validates the pipeline split
        check_kinds(self.kind, m, self.tp, lambda k: k.megatron_te if self.naming == "te" else k.megatron_local)
        return self

    # --- sizes -------------------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return self.world

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def edp(self) -> int:
        return self.world // (self.etp * self.ep * self.pp)

    @property
    def padded_vocab(self) -> int:
        return pad_to(self.model.vocab_size, self.vocab_divisor * self.tp)

    def __str__(self) -> str:
        extra = "".join(f",{k}={getattr(self, k)}" for k in ("vpp", "first_stage_layers", "last_stage_layers")
                        if getattr(self, k) not in (None, 1))
        return (f"megatron:tp={self.tp},pp={self.pp},ep={self.ep},etp={self.etp},dp={self.dp},"
                f"world={self.world}{extra} [{self.naming} names]")

    # --- pipeline ----------------------------------------------------------------------------------
    @functools.cached_property
    def _stage_layer_counts(self) -> tuple[int, ...]:
        L, p = self.model.num_layers, self.pp
        first, last = self.first_stage_layers, self.last_stage_layers
        if self.vpp > 1:
            if first is not None or last is not None:
                self._fail("first_stage_layers/last_stage_layers cannot be combined with vpp>1",
                           vpp=self.vpp, first_stage_layers=first, last_stage_layers=last)
            if p < 2:
                self._fail(f"vpp={self.vpp} needs pp>=2", vpp=self.vpp, pp=p)
            divisible(self, "num_layers", L, "pp*vpp", p * self.vpp)
            return (L // p,) * p
        if first is None and last is None:
            divisible(self, "num_layers", L, "pp", p)
            return (L // p,) * p
        if p == 1:
            self._fail("first_stage_layers/last_stage_layers need pp>=2", pp=p)
        fixed = [x for x in (first, last) if x is not None]
        if any(x < 1 for x in fixed):
            self._fail("first_stage_layers and last_stage_layers must be at least 1",
                       first_stage_layers=first, last_stage_layers=last)
        middle_stages = p - len(fixed)
        rest = L - sum(fixed)
        if middle_stages == 0:
            if rest != 0:
                self._fail(f"first_stage_layers + last_stage_layers = {sum(fixed)} must equal num_layers={L} "
                           f"when pp=2", num_layers=L)
            return (first, last)
        if rest < middle_stages or rest % middle_stages:
            self._fail(f"the {rest} layers left after first/last stages are not divisible by the "
                       f"{middle_stages} other stages", num_layers=L, first_stage_layers=first,
                       last_stage_layers=last, pp=p)
        each = rest // middle_stages
        counts = [each] * p
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        return tuple(counts)

    @functools.cached_property
    def _layer_home(self) -> tuple[tuple[int, int, int], ...]:
        """For each global layer: (stage, virtual chunk, index inside that chunk)."""
        L, p, v = self.model.num_layers, self.pp, self.vpp
        if v > 1:
            per_chunk = L // (p * v)
            home = [None] * L
            for c in range(v):
                for s in range(p):
                    start = c * (L // v) + s * per_chunk
                    for j in range(per_chunk):
                        home[start + j] = (s, c, j)
            return tuple(home)
        home, layer = [], 0
        for s, n in enumerate(self._stage_layer_counts):
            home.extend((s, 0, j) for j in range(n))
            layer += n
        return tuple(home)

    def stage_of_layer(self, layer: int) -> int:
        return self._layer_home[layer][0]

    def layer_home(self, layer: int) -> tuple[int, int, int]:
        """(pipeline stage, virtual chunk, index inside that chunk's `decoder.layers`) of a global layer."""
        return self._layer_home[layer]

    def _prefix(self, chunk: int) -> str:
        return f"model{chunk}." if self.vpp > 1 else ""

    # --- ranks -------------------------------------------------------------------------------------
    def _rank(self, sizes: dict[str, int], coords: dict[str, int]) -> int:
        rank, stride = 0, 1
        for axis in self.rank_order.split("-"):
            rank += coords.get(axis, 0) * stride
            stride *= sizes[axis]
        return rank

    def dense_rank(self, tp: int, dp: int, pp: int) -> int:
        return self._rank({"tp": self.tp, "cp": 1, "ep": 1, "dp": self.dp, "pp": self.pp},
                          {"tp": tp, "dp": dp, "pp": pp})

    def expert_rank(self, etp: int, ep: int, edp: int, pp: int) -> int:
        return self._rank({"tp": self.etp, "cp": 1, "ep": self.ep, "dp": self.edp, "pp": self.pp},
                          {"tp": etp, "ep": ep, "dp": edp, "pp": pp})

    def dense_coords(self, rank: int) -> dict[str, int]:
        """Inverse of dense_rank: {'tp', 'dp', 'pp'} of a global rank."""
        return self._coords(rank, {"tp": self.tp, "cp": 1, "ep": 1, "dp": self.dp, "pp": self.pp})

    def expert_coords(self, rank: int) -> dict[str, int]:
        """Inverse of expert_rank: {'tp' (expert-TP), 'ep', 'dp' (expert-DP), 'pp'} of a global rank."""
        return self._coords(rank, {"tp": self.etp, "cp": 1, "ep": self.ep, "dp": self.edp, "pp": self.pp})

    def _coords(self, rank: int, sizes: dict[str, int]) -> dict[str, int]:
        self._check_rank(rank)
        out = {}
        for axis in self.rank_order.split("-"):
            out[axis] = rank % sizes[axis]
            rank //= sizes[axis]
        return out

    # --- placements --------------------------------------------------------------------------------
    def value_offset(self, tensor: TensorSpec) -> float:
        return float(getattr(tensor.role, "megatron_offset", 0.0))

    def placements(self, tensor: TensorSpec, replica: int | None = None) -> list[Placement]:
        handler = _HANDLERS.get(tensor.role)
        if handler is None:  # a family-specific kind (layouts/kinds.py) places itself
            return tensor.role.megatron_placements(self, tensor)
        return handler(self, tensor)

    def rank_tensors(self, rank: int) -> dict[str, tuple[int, ...]]:
        self._check_rank(rank)
        return rank_tensor_table(self).get(rank, {})

    def placement_table(self, index: np.ndarray | Sequence[int] | None = None,
                        replica: int | None = None) -> PlacementTable:
        from .megatron_batch import megatron_table

        return megatron_table(self, index)

    def axis_strides(self, expert: bool) -> dict[str, int]:
        """Stride of each parallel axis in the global rank (rank = sum of coordinate x stride)."""
        sizes = ({"tp": self.etp, "cp": 1, "ep": self.ep, "dp": self.edp, "pp": self.pp} if expert else
                 {"tp": self.tp, "cp": 1, "ep": 1, "dp": self.dp, "pp": self.pp})
        strides, stride = {}, 1
        for axis in self.rank_order.split("-"):
            strides[axis] = stride
            stride *= sizes[axis]
        return strides

    def _replicated_dense(self, stage: int, tp: int, name: str, shape: tuple[int, ...],
                          canon_offset: tuple[int, ...], lengths: tuple[int, ...],
                          phys_offset: tuple[int, ...]) -> list[Placement]:
        return [Placement(self.dense_rank(tp, d, stage), name, shape, canon_offset, lengths, phys_offset)
                for d in range(self.dp)]

    def _layer_name(self, layer: int, suffix: str) -> tuple[int, str]:
        stage, chunk, local = self._layer_home[layer]
        return stage, f"{self._prefix(chunk)}decoder.layers.{local}.{suffix}"


# --- one placement rule per role ---------------------------------------------------------------------

def _vocab(lay: MegatronLayout, t: TensorSpec, stage: int, name: str) -> list[Placement]:
    V, H = t.shape
    rows = lay.padded_vocab // lay.tp
    out = []
    for r in range(lay.tp):
        lo, hi = r * rows, min((r + 1) * rows, V)
        n = max(hi - lo, 0)
        out += lay._replicated_dense(stage, r, name, (rows, H), (min(lo, V), 0), (n, H), (0, 0))
    return out


def _embed(lay: MegatronLayout, t: TensorSpec) -> list[Placement]:
    out = _vocab(lay, t, 0, lay._prefix(0) + "embedding.word_embeddings.weight")
    if lay.model.tie_word_embeddings and lay.pp > 1:
        # With tied embeddings and PP>1 the last stage keeps a synchronized copy as output_layer.weight.
        out += _vocab(lay, t, lay.pp - 1, lay._prefix(lay.vpp - 1) + "output_layer.weight")
    return out


def _lm_head(lay: MegatronLayout, t: TensorSpec) -> list[Placement]:
    return _vocab(lay, t, lay.pp - 1, lay._prefix(lay.vpp - 1) + "output_layer.weight")


def _final_norm(lay: MegatronLayout, t: TensorSpec) -> list[Placement]:
    name = lay._prefix(lay.vpp - 1) + "decoder.final_layernorm.weight"
    return [p for r in range(lay.tp)
            for p in lay._replicated_dense(lay.pp - 1, r, name, t.shape, (0,), t.shape, (0,))]


_NORM_NAMES = {
    ("local", Role.INPUT_NORM): "input_layernorm.weight",
    ("te", Role.INPUT_NORM): "self_attention.linear_qkv.layer_norm_weight",
    ("local", Role.POST_ATTN_NORM): "pre_mlp_layernorm.weight",
    ("te", Role.POST_ATTN_NORM): "mlp.linear_fc1.layer_norm_weight",  # dense layers; MoE layers keep pre_mlp_layernorm
    ("local", Role.Q_NORM): "self_attention.q_layernorm.weight",
    ("te", Role.Q_NORM): "self_attention.q_layernorm.weight",
    ("local", Role.K_NORM): "self_attention.k_layernorm.weight",
    ("te", Role.K_NORM): "self_attention.k_layernorm.weight",
}


def _layer_norm(lay: MegatronLayout, t: TensorSpec) -> list[Placement]:
    suffix = _NORM_NAMES[(lay.naming, t.role)]
    if t.role == Role.POST_ATTN_NORM and lay.model.is_moe_layer(t.layer):
        suffix = "pre_mlp_layernorm.weight"
    stage, name = lay._layer_name(t.layer, suffix)
    return [p for r in range(lay.tp) for p in lay._replicated_dense(stage, r, name, t.shape, (0,), t.shape, (0,))]


def _qkv(lay: MegatronLayout, t: TensorSpec) -> list[Placement]:
    """linear_qkv is the interleaved [(nq + 2g) d, H] matrix split into contiguous row blocks over TP.

    With g >= tp each rank holds whole query groups; megatron-core also accepts g < tp, and then a rank's
    block cuts through a group (g=1, tp=2: rank 0 holds q0..q2, rank 1 holds q3, k, v).
    """
    m = lay.model
    d, g, H = m.head_dim, m.num_key_value_heads, m.hidden_size
    hpg = m.num_attention_heads // g
    per_rank = (m.num_attention_heads + 2 * g) * d // lay.tp
    shape = (per_rank, H)
    stage, name = lay._layer_name(t.layer, "self_attention.linear_qkv.weight")
    slot, rows = {Role.Q: (0, hpg * d), Role.K: (hpg * d, d), Role.V: ((hpg + 1) * d, d)}[t.role]
    out = []
    for grp in range(g):
        start = grp * (hpg + 2) * d + slot  # global interleaved row of this group's q (or k, v) block
        for r in range(start // per_rank, (start + rows - 1) // per_rank + 1):
            lo, hi = max(start, r * per_rank), min(start + rows, (r + 1) * per_rank)
            out += lay._replicated_dense(stage, r, name, shape, (grp * rows + lo - start, 0), (hi - lo, H),
                                         (lo - r * per_rank, 0))
    return out


def _column_split(lay: MegatronLayout, t: TensorSpec, suffix: str, rows_total: int, phys_row: int,
                  n_rows_phys: int) -> list[Placement]:
    """Split dim 0 of the canonical tensor over TP; place at `phys_row` of a [n_rows_phys, H] tensor."""
    stage, name = lay._layer_name(t.layer, suffix)
    per = rows_total // lay.tp
    cols = t.shape[1]
    return [p for r in range(lay.tp)
            for p in lay._replicated_dense(stage, r, name, (n_rows_phys, cols), (r * per, 0), (per, cols),
                                           (phys_row, 0))]


def _row_split(lay: MegatronLayout, t: TensorSpec, suffix: str) -> list[Placement]:
    """Split dim 1 (the input features) over TP."""
    stage, name = lay._layer_name(t.layer, suffix)
    rows, cols = t.shape
    per = cols // lay.tp
    return [p for r in range(lay.tp)
            for p in lay._replicated_dense(stage, r, name, (rows, per), (0, r * per), (rows, per), (0, 0))]


def _gate_up(lay: MegatronLayout, t: TensorSpec) -> list[Placement]:
    F = t.shape[0]
    per = F // lay.tp
    return _column_split(lay, t, "mlp.linear_fc1.weight", F, 0 if t.role == Role.GATE else per, 2 * per)


def _router(lay: MegatronLayout, t: TensorSpec) -> list[Placement]:
    stage, name = lay._layer_name(t.layer, "mlp.router.weight")
    return [p for r in range(lay.tp)
            for p in lay._replicated_dense(stage, r, name, t.shape, (0, 0), t.shape, (0, 0))]


def _expert(lay: MegatronLayout, t: TensorSpec) -> list[Placement]:
    m = lay.model
    per_ep = m.num_experts // lay.ep
    ep, j = divmod(t.expert, per_ep)
    fc = "linear_fc2" if t.role == Role.EXPERT_DOWN else "linear_fc1"
    suffix = (f"mlp.experts.local_experts.{j}.{fc}.weight" if lay.naming == "local"
              else f"mlp.experts.{fc}.weight{j}")
    stage, name = lay._layer_name(t.layer, suffix)
    Fm, H = m.moe_intermediate_size, m.hidden_size
    per = Fm // lay.etp
    out = []
    for r in range(lay.etp):
        if t.role == Role.EXPERT_DOWN:
            shape, coff, lens, poff = (H, per), (0, r * per), (H, per), (0, 0)
        else:
            shape, coff, lens = (2 * per, H), (r * per, 0), (per, H)
            poff = (0 if t.role == Role.EXPERT_GATE else per, 0)
        out += [Placement(lay.expert_rank(r, ep, d, stage), name, shape, coff, lens, poff)
                for d in range(lay.edp)]
    return out


_HANDLERS = {
    Role.EMBED: _embed,
    Role.LM_HEAD: _lm_head,
    Role.FINAL_NORM: _final_norm,
    Role.INPUT_NORM: _layer_norm,
    Role.POST_ATTN_NORM: _layer_norm,
    Role.Q_NORM: _layer_norm,
    Role.K_NORM: _layer_norm,
    Role.Q: _qkv,
    Role.K: _qkv,
    Role.V: _qkv,
    Role.O: lambda lay, t: _row_split(lay, t, "self_attention.linear_proj.weight"),
    Role.GATE: _gate_up,
    Role.UP: _gate_up,
    Role.DOWN: lambda lay, t: _row_split(lay, t, "mlp.linear_fc2.weight"),
    Role.ROUTER: _router,
    Role.EXPERT_GATE: _expert,
    Role.EXPERT_UP: _expert,
    Role.EXPERT_DOWN: _expert,
}


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
