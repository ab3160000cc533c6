"""The one vocabulary of cuts: how tensor parallelism splits a tensor, on either side.

Rows and columns are the tensor's own dimensions: `RowBlocks` splits dim 0, `ColumnBlocks` dim 1 (Megatron and
vLLM name layers after the matmul instead: row blocks of a weight are "column-parallel"). A cut names a physical
tensor and states only `pieces` (what TP rank r holds, where); from it come `placements` (one tensor) and
`add_rows` (many tensors at once, as numpy rows). The layout supplies the group of ranks (`Group`). A
`TensorKind` is a kind of tensor: its cuts on each engine. Tensors of more than 2 dimensions are cut on dim 0
only. A cut the engines do not make is refused by the family, never approximated."""
from __future__ import annotations

import abc
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence

import numpy as np

from ..errors import LayoutError
from .base import Placement, TableBuilder, as_2d

Shape = tuple[int, ...]
Piece = tuple[int, Shape, Shape, Shape]  # (tp rank, canonical offset, lengths, physical offset) of one piece


@dataclass(frozen=True)
class Group:
    """The ranks one tensor is cut over: TP rank r of copy c is global rank `first + r * stride + copies[c]`
    (`first` comes with each tensor). `vocab`: the padded vocabulary; `stack` > 0: the physical tensor stacks
    `stack` such tensors on a new dim 0 (vLLM's experts); `copies_first`: rows copy by copy, not piece by piece."""

    side: str
    tp: int
    stride: int = 1
    copies: tuple[int, ...] = (0,)
    vocab: int = 0
    stack: int = 0
    copies_first: bool = False
    lora_rank: int = 0         # LoRA buffers padded to this rank (vLLM's max_lora_rank); 0: the adapter's own
    lora_sharded: bool = False  # vLLM's fully_sharded_loras: A of a column-parallel layer cut on its rank dim


@dataclass(frozen=True)
class Cut(abc.ABC):
    """A physical tensor `name` (`{i}`: the layer, `{j}`: the local expert) and how TP cuts a tensor into it.

    `at`: a Megatron tensor outside the layers ("first" / "last" stage, "last_copy": a tied embedding's copy).
    `moe_name`: the name in MoE layers, where it differs. `stacked`: local expert `{j}`'s slot on dim 0 of a
    per-rank stack. `expert`: a tensor all experts share, placed as expert `expert`'s copy."""

    name: str
    at: Literal["first", "last", "last_copy"] | None = field(default=None, kw_only=True)
    moe_name: str | None = field(default=None, kw_only=True)
    stacked: bool = field(default=False, kw_only=True)
    expert: int | None = field(default=None, kw_only=True)

    @abc.abstractmethod
    def pieces(self, what: str, shape: Shape, g: Group) -> tuple[Shape, list[Piece]]:
        """(physical shape, pieces) of a tensor of `shape` (`what` in errors); LayoutError where `g` cannot cut it."""

    def placements(self, what: str, shape: Shape, g: Group, name: str, first: int, slot: int = 0) -> list[Placement]:
        """Where one tensor lives: the per-tensor answer."""
        phys, pieces = self.pieces(what, shape, g)
        if g.stack:
            phys, pieces = (g.stack, *phys), [(r, c, n, (slot, *p)) for r, c, n, p in pieces]
        if g.copies_first:
            return [Placement(first + r * g.stride + k, name, phys, c, n, p) for k in g.copies for r, c, n, p in pieces]
        return [Placement(first + r * g.stride + k, name, phys, c, n, p) for r, c, n, p in pieces for k in g.copies]

    def add_rows(self, b: TableBuilder, what: str, shape: Shape, g: Group, canon: np.ndarray,
                 keys: Sequence[np.ndarray | int], name: Callable[..., str], first: np.ndarray | int,
                 slot: np.ndarray | int = 0) -> None:
        """Where many tensors of `shape` live, as rows (the batched answer): tensor k is named
        `name(*(column[k] for column in keys))`, its group starts at `first[k]`, its slot is `slot[k]`."""
        phys, pieces = self.pieces(what, shape, g)
        at_piece, at_copy = ((1, 1, -1), (1, -1, 1)) if g.copies_first else ((1, -1, 1), (1, 1, -1))

        def per_piece(x: list[int]) -> np.ndarray | int:  # a scalar where every piece agrees: rows stay views
            return x[0] if len(set(x)) == 1 else np.asarray(x, dtype=np.int64).reshape(at_piece)

        boxes = [(r, *sum(as_2d(c, n), ()), np.ravel_multi_index(p, phys)) for r, c, n, p in pieces]
        r, c0, c1, n0, n1, origin = (per_piece(list(x)) for x in zip(*boxes))
        if g.stack:
            origin = origin + np.asarray(slot, dtype=np.int64).reshape(-1, 1, 1) * math.prod(phys)
            phys = (g.stack, *phys)
        tensor = lambda x: np.asarray(x, dtype=np.int64).reshape(-1, 1, 1)  # noqa: E731  one value per tensor
        rank = tensor(first) + r * g.stride + np.asarray(g.copies, dtype=np.int64).reshape(at_copy)
        b.add(tensor(canon), rank, tensor(b.kinds_for(keys, name, phys)), c0, c1, n0, n1, origin, phys[-1])


def _per(what: str, shape: Shape, dim: int, g: Group) -> int:
    if shape[dim] % g.tp:
        raise LayoutError(g.side, f"{what}: dim {dim} of shape {shape} is not divisible by tp={g.tp}",
                          {"tensor": what, "tp": g.tp})
    return shape[dim] // g.tp


def _zeros(shape: Shape) -> Shape:
    return (0,) * len(shape)


@dataclass(frozen=True)
class Replicated(Cut):
    """The whole tensor on every TP rank; with `rows`, at row `row` of a replicated [`rows`, ...] stack (vLLM's
    fused_qkv_a_proj)."""

    row: int = 0
    rows: int = 0

    def pieces(self, what: str, shape: Shape, g: Group) -> tuple[Shape, list[Piece]]:
        phys, at = ((self.rows, *shape[1:]), (self.row, *_zeros(shape[1:]))) if self.rows else (shape, _zeros(shape))
        return phys, [(r, _zeros(shape), shape, at) for r in range(g.tp)]


@dataclass(frozen=True)
class Vocab(Cut):
    """Vocabulary rows padded to `Group.vocab` and split into row blocks over TP; padding rows hold no data."""

    def pieces(self, what: str, shape: Shape, g: Group) -> tuple[Shape, list[Piece]]:
        V, H = shape
        rows = g.vocab // g.tp
        return (rows, H), [(r, (min(r * rows, V), 0), (max(min((r + 1) * rows, V) - r * rows, 0), H), (0, 0))
                           for r in range(g.tp)]


@dataclass(frozen=True)
class RowBlocks(Cut):
    """Dim 0 split into contiguous blocks over TP, on each rank part `part` of `parts` equal blocks ([gate_r; up_r])."""

    part: int = 0
    parts: int = 1

    def pieces(self, what: str, shape: Shape, g: Group) -> tuple[Shape, list[Piece]]:
        per, rest = _per(what, shape, 0, g), shape[1:]
        pad = _zeros(rest)
        return (self.parts * per, *rest), [(r, (r * per, *pad), (per, *rest), (self.part * per, *pad))
                                           for r in range(g.tp)]


@dataclass(frozen=True)
class ColumnBlocks(Cut):
    """Dim 1 split into contiguous blocks over TP."""

    def pieces(self, what: str, shape: Shape, g: Group) -> tuple[Shape, list[Piece]]:
        rows, per = shape[0], _per(what, shape, 1, g)
        return (rows, per), [(r, (0, r * per), (rows, per), (0, 0)) for r in range(g.tp)]


@dataclass(frozen=True)
class Stacked(Cut):
    """Dim 0 of a per-rank stack of unequal parts, each split over TP: rank r holds [part_0 block r; part_1 block
    r; ...] (GDN's in_proj, conv1d). `sizes`: the parts' global rows; the canonical tensor is parts `first` ..
    `first + count - 1`; `heads`: rows per head of each part (TP must give each rank whole heads)."""

    sizes: tuple[int, ...] = ()
    first: int = 0
    count: int = 1
    heads: tuple[int, ...] = ()

    def pieces(self, what: str, shape: Shape, g: Group) -> tuple[Shape, list[Piece]]:
        mine = self.sizes[self.first:self.first + self.count]
        if sum(mine) != shape[0]:
            raise LayoutError(g.side, f"{what}: {shape[0]} rows, but stack parts {self.first}.."
                              f"{self.first + self.count - 1} of {self.name} have {sum(mine)}", {"tensor": what})
        counts = [s // h for s, h in zip(self.sizes, self.heads or (1,) * len(self.sizes))]
        if any(n % g.tp for n in counts):
            raise LayoutError(g.side, f"{what}: tp={g.tp} does not divide the head counts {counts} "
                              f"of the parts of {self.name}", {"tensor": what, "tp": g.tp})
        per = [s // g.tp for s in self.sizes]
        rest, pad = shape[1:], _zeros(shape[1:])
        starts = np.cumsum([0, *self.sizes]).tolist()
        return (sum(per), *rest), [
            (r, (starts[j] - starts[self.first] + r * per[j], *pad), (per[j], *rest), (sum(per[:j]), *pad))
            for r in range(g.tp) for j in range(self.first, self.first + self.count)]


@dataclass(frozen=True)
class GlobalRows(Cut):
    """Dim 0 of a global [`total`, ...] stack cut into TP row blocks (Megatron's linear_qkv): canonical rows
    [c, c + n) sit at global rows [g, g + n) for each (c, g, n) in `blocks`, split at rank boundaries."""

    total: int = 0
    blocks: tuple[tuple[int, int, int], ...] = ()

    def pieces(self, what: str, shape: Shape, g: Group) -> tuple[Shape, list[Piece]]:
        if self.total % g.tp:
            raise LayoutError(g.side, f"{what}: the {self.total} rows of {self.name} are not divisible by "
                              f"tp={g.tp}", {"tensor": what, "tp": g.tp})
        per = self.total // g.tp
        rest, pad = shape[1:], _zeros(shape[1:])
        out = []
        for c, start, n in self.blocks:
            for r in range(start // per, (start + n - 1) // per + 1):
                lo, hi = max(start, r * per), min(start + n, (r + 1) * per)
                out.append((r, (c + lo - start, *pad), (hi - lo, *rest), (lo - r * per, *pad)))
        return (per, *rest), out


@dataclass(frozen=True)
class QkvParallel(Cut):
    """vLLM's QKVParallelLinear: rank r holds [q_r; k_r; v_r], q (`q_rows` rows) split over TP, k and v by head
    (replicated when tp > `kv_heads`); `part` 0, 1, 2 is q, k, v; `alone`: the part is a tensor of its own (LoRA B)."""

    q_rows: int = 0
    kv_heads: int = 1
    head_dim: int = 1
    part: int = 0
    alone: bool = False

    def pieces(self, what: str, shape: Shape, g: Group) -> tuple[Shape, list[Piece]]:
        heads, d, tp = self.kv_heads, self.head_dim, g.tp
        if self.q_rows % tp or (heads % tp if heads >= tp else tp % heads):
            raise LayoutError(g.side, f"{what}: tp={tp} cuts neither {self.q_rows} query rows nor {heads} KV "
                              f"heads evenly", {"tensor": what, "tp": tp})
        q, kv = self.q_rows // tp, max(1, heads // tp)
        rest, pad = shape[1:], _zeros(shape[1:])
        rows = (q if self.part == 0 else kv * d) if self.alone else q + 2 * kv * d
        if self.part == 0:
            return (rows, *rest), [(r, (r * q, *pad), (q, *rest), (0, *pad)) for r in range(tp)]
        row = 0 if self.alone else q if self.part == 1 else q + kv * d
        return (rows, *rest), [(r, ((r * kv if tp <= heads else r // (tp // heads)) * d, *pad),
                                          (kv * d, *rest), (row, *pad)) for r in range(tp)]


@dataclass(frozen=True)
class Refused(Cut):
    """A tensor this side cannot hold: any group raises `reason` (and `fix`), so its layout fails at construction."""

    reason: str = ""
    fix: str = ""

    def pieces(self, what: str, shape: Shape, g: Group) -> tuple[Shape, list[Piece]]:
        raise LayoutError(g.side, f"{what}: {self.reason}", {"tensor": what}, self.fix)


def _lora_rank(what: str, r: int, g: Group) -> int:
    """The rank dim of a LoRA slot: the engine's padded rank, which must hold the adapter's rank r."""
    if g.lora_rank and r > g.lora_rank:
        raise LayoutError(g.side, f"{what}: the adapter's rank r={r} exceeds max_lora_rank={g.lora_rank}",
                          {"tensor": what, "max_lora_rank": g.lora_rank},
                          "start the engine with max_lora_rank >= r, or train a smaller rank")
    return g.lora_rank or r


@dataclass(frozen=True)
class LoraA(Cut):
    """An engine's LoRA A slot, [R, in] with R = `Group.lora_rank` (rows r.. are padding): column blocks where the
    base layer is row-parallel (`split_input`), else whole, or R/tp row blocks with `Group.lora_sharded`."""

    split_input: bool = False

    def pieces(self, what: str, shape: Shape, g: Group) -> tuple[Shape, list[Piece]]:
        R = _lora_rank(what, shape[0], g)
        if self.split_input or not g.lora_sharded:
            phys, pieces = (ColumnBlocks if self.split_input else Replicated)(self.name).pieces(what, shape, g)
            return (R, phys[1]), pieces
        if R % g.tp:
            raise LayoutError(g.side, f"{what}: fully sharded LoRA needs max_lora_rank={R} divisible by tp={g.tp}",
                              {"tensor": what, "tp": g.tp})
        return Vocab(self.name).pieces(what, shape, dataclasses.replace(g, vocab=R))  # rows r.. of R are padding


@dataclass(frozen=True)
class LoraB(Cut):
    """An engine's LoRA B slot, [out rows, R] (columns r.. are padding): output rows cut by `rows` (the base
    layer's cut); None: whole, or row blocks with `Group.lora_sharded`."""

    rows: Cut | None = None

    def pieces(self, what: str, shape: Shape, g: Group) -> tuple[Shape, list[Piece]]:
        R = _lora_rank(what, shape[1], g)
        inner = self.rows or (RowBlocks(self.name) if g.lora_sharded else Replicated(self.name))
        phys, pieces = inner.pieces(what, shape, g)
        return (phys[0], R), pieces


@dataclass(frozen=True)
class TensorKind:
    """One kind of tensor (a TensorSpec's role): its cuts on each engine, by engine name.

    Args:
        label: the name reports and errors show.
        cuts: engine name -> its cut or cuts (where the tensor lives in several places); kept as sorted pairs.
        expert: expert parallelism distributes it.
        megatron_offset: Megatron stores canonical + this (Layout.value_offset).
        linear: a linear layer's weight (an FP8 block-scaled engine quantizes it).
    """

    label: str
    cuts: Any
    expert: bool = False
    megatron_offset: float = 0.0
    linear: bool = False

    def __post_init__(self) -> None:
        pairs = self.cuts.items() if isinstance(self.cuts, Mapping) else self.cuts
        object.__setattr__(self, "cuts", tuple(sorted((str(engine), (c,) if isinstance(c, Cut) else tuple(c))
                                                      for engine, c in pairs)))

    def cuts_for(self, engine: str) -> tuple[Cut, ...] | None:
        """The cuts that place this kind on `engine`; None where the kind declares none for it."""
        return dict(self.cuts).get(engine)

    def with_cuts(self, **cuts: "Cut | tuple[Cut, ...]") -> "TensorKind":
        """This kind with the cuts of some engines replaced or added."""
        return dataclasses.replace(self, cuts={**dict(self.cuts), **cuts})

    @property
    def value(self) -> str:
        """The kind's `label` (a `Role`'s value reads the same way in reports)."""
        return self.label
