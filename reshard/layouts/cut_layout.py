"""A layout that places every canonical tensor by its kind's cuts (Megatron and vLLM both are one).

The subclass answers two questions about a kind of tensor: which cuts place it on this side (`_cuts`), and, for
tensors of that kind at given layers and experts, where each cut's group of ranks starts and what the physical
tensor is named (`_place`). Everything else -- one tensor's placements, the batched table of many, the check at
construction that every cut fits -- is the same code for both sides, so the batched answer is the per-tensor
one by construction.
"""
from __future__ import annotations

import abc
from typing import Callable, Hashable, Iterator, NamedTuple, Sequence

import numpy as np

from .base import Layout, Placement, PlacementTable, TableBuilder, rank_tensor_table
from .cuts import Cut, Group, Kind
from .model import Entry, ModelSpec, Role, TensorSpec
from .roles import kind_of


class Where(NamedTuple):
    """Where a cut puts tensors of one kind: the group, each tensor's first rank, name keys and the name of a
    key (and, for stacked tensors, each tensor's slot)."""

    group: Group
    first: np.ndarray | int
    keys: np.ndarray
    name: Callable[..., str]
    slot: np.ndarray | int = 0


class CutLayout(Layout):
    @abc.abstractmethod
    def _cuts(self, kind: Kind) -> tuple[Cut, ...]:
        """The cuts that place tensors of `kind` on this side."""

    @abc.abstractmethod
    def _place(self, cut: Cut, kind: Kind, layer: np.ndarray, expert: np.ndarray,
               replica: int | None) -> Where | None:
        """Where `cut` puts the tensors of `kind` at `layer` / `expert`; None where it puts nothing."""

    def placements(self, tensor: TensorSpec, replica: int | None = None) -> list[Placement]:
        kind = kind_of(self.model, tensor.role)
        out: list[Placement] = []
        for cut in self._cuts(kind):
            w = self._place(cut, kind, np.asarray([tensor.layer]), np.asarray([tensor.expert]), replica)
            if w is not None:
                first, slot = (int(np.asarray(x).reshape(-1)[0]) for x in (w.first, w.slot))
                out += cut.placements(tensor.name, tensor.shape, w.group, w.name(*w.keys[0].tolist()), first, slot)
        return out

    def placement_table(self, index: np.ndarray | Sequence[int] | None = None,
                        replica: int | None = None) -> PlacementTable:
        c, b = self.model.canonical, TableBuilder()
        for entry, idx in entry_groups(self.model, index):
            kind = kind_of(self.model, entry.role)
            for cut in self._cuts(kind):
                w = self._place(cut, kind, c.layer[idx], c.expert[idx], replica)
                if w is not None:
                    cut.add_rows(b, self.model.tensor_name(int(idx[0])), entry.shape, w.group, idx, w.keys, w.name,
                                 w.first, w.slot)
        return b.table()

    def rank_tensors(self, rank: int) -> dict[str, tuple[int, ...]]:
        self._check_rank(rank)
        return rank_tensor_table(self).get(rank, {})

    def _check_cuts(self) -> None:
        """Raise LayoutError now, at construction, if a cut of this side cannot split its tensors."""
        c = self.model.canonical
        for entry, idx in entry_groups(self.model, None):
            kind = kind_of(self.model, entry.role)
            for cut in self._cuts(kind):
                w = self._place(cut, kind, c.layer[idx[:1]], c.expert[idx[:1]], 0)
                if w is not None:
                    cut.pieces(self.model.tensor_name(int(idx[0])), entry.shape, w.group)


def entry_groups(spec: ModelSpec, index: np.ndarray | Sequence[int] | None) -> Iterator[tuple[Entry, np.ndarray]]:
    """The canonical tensors `index` (default all) grouped by family entry, the shared roles first (in `Role`'s
    order), then the family's own kinds as they first appear: the order physical tensors are first named in."""
    c = spec.canonical
    index = np.arange(len(c), dtype=np.int64) if index is None else np.asarray(index, dtype=np.int64)
    codes = c.entry[index]
    order: dict[Hashable, int] = {r: k for k, r in enumerate(Role)}
    for e in c.entries:
        order.setdefault(e.role, len(order))
    present = np.flatnonzero(np.bincount(codes, minlength=len(c.entries))).tolist()
    for code in sorted(present, key=lambda e: (order[c.entries[e].role], e)):
        yield c.entries[code], index[codes == code]
