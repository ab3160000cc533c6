"""Per-kind-of-tensor placement rules, for tensors a family adds beyond the shared roles of `model.Role`.

A family tags such a tensor with a `Kind`: one `Rule` per Megatron naming (local, te) and one for vLLM. A rule
is a tiny frozen declaration (the physical name and how TP cuts the tensor); the layouts call it when the
tensor's role is not one of their built-in `Role`s. Only cuts the placement model can express exist here:
whole copies, contiguous row blocks (optionally one part of a per-rank stack of parts, of equal or unequal
sizes), row blocks of a global stack cut over TP, vLLM's fused QKV, contiguous column blocks, and a whole copy at
a row offset of a larger replicated tensor. Tensors of more than 2 dimensions are cut on dim 0 only. Anything
else must be refused by the family with a clear error, never approximated.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import LayoutError
from .base import Placement

if TYPE_CHECKING:
    from .megatron import MegatronLayout
    from .model import TensorSpec
    from .vllm import VllmLayout


@dataclass(frozen=True)
class Rule(abc.ABC):
    """Where a per-layer tensor lives on one side. `name` is the Megatron suffix after `decoder.layers.{i}.`
    or the full vLLM name with `{i}` for the layer."""

    name: str

    @abc.abstractmethod
    def cut(self, t: "TensorSpec", tp: int, kind: str) -> list[tuple[int, tuple, tuple, tuple, tuple]]:
        """(tp rank, physical shape, canonical offset, lengths, physical offset) for each TP rank."""

    def megatron(self, lay: "MegatronLayout", t: "TensorSpec") -> list[Placement]:
        stage, name = lay._layer_name(t.layer, self.name)
        return [p for r, shape, coff, lens, poff in self.cut(t, lay.tp, "megatron")
                for p in lay._replicated_dense(stage, r, name, shape, coff, lens, poff)]

    def vllm(self, lay: "VllmLayout", t: "TensorSpec") -> list[Placement]:
        name = self.name.format(i=t.layer)
        return [Placement(r, name, shape, coff, lens, poff) for r, shape, coff, lens, poff in self.cut(t, lay.tp, "vllm")]


def _split(kind: str, t: "TensorSpec", dim: int, tp: int) -> int:
    if t.shape[dim] % tp:
        raise LayoutError(kind, f"{t.name}: dim {dim} of shape {t.shape} is not divisible by tp={tp}",
                          {"tensor": t.name, "tp": tp})
    return t.shape[dim] // tp


@dataclass(frozen=True)
class Replicated(Rule):
    """The whole tensor on every TP rank."""

    def cut(self, t, tp, kind):
        zero = (0,) * len(t.shape)
        return [(r, t.shape, zero, t.shape, zero) for r in range(tp)]


@dataclass(frozen=True)
class RowBlocks(Rule):
    """Dim 0 split into contiguous blocks over TP (column-parallel linear); on each rank the block is part
    `part` of a stack of `parts` equal blocks (e.g. [gate_r; up_r] is parts=2)."""

    part: int = 0
    parts: int = 1

    def cut(self, t, tp, kind):
        per = _split(kind, t, 0, tp)
        rest = t.shape[1:]
        pad = (0,) * len(rest)
        return [(r, (self.parts * per, *rest), (r * per, *pad), (per, *rest), (self.part * per, *pad))
                for r in range(tp)]


@dataclass(frozen=True)
class ColumnBlocks(Rule):
    """Dim 1 split into contiguous blocks over TP (row-parallel linear)."""

    def cut(self, t, tp, kind):
        rows = t.shape[0]
        per = _split(kind, t, 1, tp)
        return [(r, (rows, per), (0, r * per), (rows, per), (0, 0)) for r in range(tp)]


@dataclass(frozen=True)
class ReplicatedAt(Rule):
    """The whole tensor on every TP rank, at row `row` of a replicated [`rows`, ...] tensor (a fused stack
    such as vLLM's fused_qkv_a_proj = [q_a_proj; kv_a_proj_with_mqa])."""

    row: int = 0
    rows: int = 0

    def cut(self, t, tp, kind):
        rest = t.shape[1:]
        pad = (0,) * len(rest)
        return [(r, (self.rows, *rest), (0, *pad), t.shape, (self.row, *pad)) for r in range(tp)]


@dataclass(frozen=True)
class Stacked(Rule):
    """Dim 0 of a per-rank stack of parts of unequal sizes, each part split evenly over TP: rank r holds
    [part_0 block r; part_1 block r; ...] (vLLM's MergedColumnParallelLinear with several output sizes, Megatron's
    GDN in_proj and conv1d). `sizes` are the parts' global row counts; the canonical tensor is parts `first` ..
    `first + count - 1` one after another (HF's in_proj_qkv is the q, k and v parts). Other dimensions stay whole."""

    sizes: tuple[int, ...] = ()
    first: int = 0
    count: int = 1
    heads: tuple[int, ...] = ()  # rows per head of each part (default 1): TP must give each rank whole heads

    def cut(self, t, tp, kind):
        mine = self.sizes[self.first:self.first + self.count]
        if sum(mine) != t.shape[0]:
            raise LayoutError(kind, f"{t.name}: {t.shape[0]} rows, but stack parts {self.first}.."
                              f"{self.first + self.count - 1} of {self.name} have {sum(mine)}", {"tensor": t.name})
        heads = self.heads or (1,) * len(self.sizes)
        bad = [s // h for s, h in zip(self.sizes, heads) if (s // h) % tp]
        if bad:
            counts = [s // h for s, h in zip(self.sizes, heads)]
            raise LayoutError(kind, f"{t.name}: tp={tp} does not divide the head counts {counts} "
                              f"of the parts of {self.name}", {"tensor": t.name, "tp": tp})
        per = [s // tp for s in self.sizes]
        rest, pad = t.shape[1:], (0,) * (len(t.shape) - 1)
        out = []
        for r in range(tp):
            canon = 0
            for j in range(self.first, self.first + self.count):
                out.append((r, (sum(per), *rest), (canon + r * per[j], *pad), (per[j], *rest), (sum(per[:j]), *pad)))
                canon += self.sizes[j]
        return out


@dataclass(frozen=True)
class GlobalRows(Rule):
    """Dim 0 of a global [`total`, ...] stack cut into tp contiguous row blocks (Megatron's linear_qkv): canonical
    rows [c, c + n) sit at global rows [g, g + n) for each (c, g, n) in `blocks`. A block that crosses a rank
    boundary is split there (fewer query groups than tp)."""

    total: int = 0
    blocks: tuple[tuple[int, int, int], ...] = ()

    def cut(self, t, tp, kind):
        if self.total % tp:
            raise LayoutError(kind, f"{t.name}: the {self.total} rows of {self.name} are not divisible by tp={tp}",
                              {"tensor": t.name, "tp": tp})
        per = self.total // tp
        rest, pad = t.shape[1:], (0,) * (len(t.shape) - 1)
        out = []
        for c, g, n in self.blocks:
            for r in range(g // per, (g + n - 1) // per + 1):
                lo, hi = max(g, r * per), min(g + n, (r + 1) * per)
                out.append((r, (per, *rest), (c + lo - g, *pad), (hi - lo, *rest), (lo - r * per, *pad)))
        return out


@dataclass(frozen=True)
class QkvParallel(Rule):
    """vLLM's QKVParallelLinear: rank r holds [q_r; k_r; v_r]; q (`q_rows` global rows) is split over TP, k and v
    by head, each of the `kv_heads` heads replicated on tp / kv_heads ranks when tp > kv_heads. `part` 0, 1, 2 is
    q, k, v. (The shared Role.Q/K/V rule, with the q part's size given: a gated q_proj holds 2 rows per head.)"""

    q_rows: int = 0
    kv_heads: int = 1
    head_dim: int = 1
    part: int = 0

    def cut(self, t, tp, kind):
        g, d = self.kv_heads, self.head_dim
        if self.q_rows % tp or (g % tp if g >= tp else tp % g):
            raise LayoutError(kind, f"{t.name}: tp={tp} cuts neither {self.q_rows} query rows nor {g} KV heads "
                              f"evenly", {"tensor": t.name, "tp": tp})
        q, kv = self.q_rows // tp, max(1, g // tp)
        shape = (q + 2 * kv * d, *t.shape[1:])
        pad = (0,) * (len(t.shape) - 1)
        out = []
        for r in range(tp):
            if self.part == 0:
                out.append((r, shape, (r * q, *pad), (q, *t.shape[1:]), (0, *pad)))
            else:
                first = r * kv if tp <= g else r // (tp // g)
                row = q if self.part == 1 else q + kv * d
                out.append((r, shape, (first * d, *pad), (kv * d, *t.shape[1:]), (row, *pad)))
        return out


@dataclass(frozen=True)
class Kind:
    """A family-specific kind of tensor: its placement rule on each side. Used as a TensorSpec's role.

    `label` is what reports and errors show; `expert` says whether expert parallelism distributes it (the
    kinds declared so far are all dense: shared experts are TP-split like a dense MLP on both sides).
    """

    label: str
    megatron_local: Rule
    megatron_te: Rule
    vllm: Rule
    expert: bool = False
    megatron_offset: float = 0.0  # Megatron stores canonical + this (Layout.value_offset)

    @property
    def value(self) -> str:  # mirrors Role.value for reports
        return self.label

    @property
    def is_expert(self) -> bool:
        return self.expert

    def megatron_placements(self, lay: "MegatronLayout", t: "TensorSpec") -> list[Placement]:
        rule = self.megatron_te if lay.naming == "te" else self.megatron_local
        return rule.megatron(lay, t)

    def vllm_placements(self, lay: "VllmLayout", t: "TensorSpec") -> list[Placement]:
        return self.vllm.vllm(lay, t)


def same(label: str, megatron: Rule, vllm: Rule, megatron_offset: float = 0.0) -> Kind:
    """A kind whose Megatron name and cut do not depend on local vs TE naming."""
    return Kind(label, megatron, megatron, vllm, megatron_offset=megatron_offset)


def shared_expert_kinds(vllm_module: str, label: str = "shared_expert") -> tuple[Kind, Kind, Kind]:
    """gate / up / down of a shared expert: Megatron's fused linear_fc1 [gate; up] and linear_fc2, TP-split like a
    dense MLP; vLLM's `{vllm_module}gate_up_proj` and `{vllm_module}down_proj` (the module name differs by family)."""
    fc1, fc2 = "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight"
    return (same(f"{label}_gate", RowBlocks(fc1, 0, 2), RowBlocks(vllm_module + "gate_up_proj.weight", 0, 2)),
            same(f"{label}_up", RowBlocks(fc1, 1, 2), RowBlocks(vllm_module + "gate_up_proj.weight", 1, 2)),
            same(f"{label}_down", ColumnBlocks(fc2), ColumnBlocks(vllm_module + "down_proj.weight")))


def check_kinds(kind: str, model, tp: int, pick) -> None:
    """Raise LayoutError now (at layout construction) if any family-specific tensor cannot be cut over `tp`;
    `pick(Kind) -> Rule` selects the rule of this side."""
    seen = set()
    for t in model.tensors:
        if isinstance(t.role, Kind) and (t.role, t.shape) not in seen:
            seen.add((t.role, t.shape))
            pick(t.role).cut(t, tp, kind)
