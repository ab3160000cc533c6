"""A layout that places every canonical tensor by its kind's cuts (Megatron and vLLM both are one).

A subclass answers one question (`_place`: where a cut's group of ranks starts and what the physical tensor is
named); one tensor's placements, the batched table and the check at construction are shared code, so the batched
answer is the per-tensor one by construction."""
from __future__ import annotations

import abc
from typing import Callable, Hashable, Iterator, NamedTuple, Sequence

import numpy as np

from .base import Layout, Placement, PlacementTable, TableBuilder
from .cuts import Cut, Group, TensorKind
from .model import Entry, ModelSpec, Role, TensorSpec
from .registry import engine_cuts
from .roles import kind_of


class Where(NamedTuple):
    """Where a cut puts tensors of one kind: the group, each tensor's first rank, its name keys, the name of a key
    and its slot (arrays, one entry per tensor, or scalars all share). `tensors`: where tensors have several
    copies (an expert's EPLB replicas), which tensor each entry is; None: one entry per tensor."""

    group: Group
    first: np.ndarray | int
    keys: tuple[np.ndarray | int, ...]
    name: Callable[..., str]
    slot: np.ndarray | int = 0
    tensors: np.ndarray | None = None


class CutLayout(Layout):
    """A layout whose tensors are placed by their kinds' cuts; a subclass says where each cut's group starts."""

    @property
    def cut_set(self) -> str:
        """Whose cuts a TensorKind gives this layout: its engine's (a layout with several namings picks one)."""
        return self.engine

    def _cuts(self, kind: TensorKind) -> tuple[Cut, ...]:
        """The cuts that place tensors of `kind` on this side (`engine_cuts`)."""
        return engine_cuts(self.model, kind, self.cut_set)

    @abc.abstractmethod
    def _place(self, cut: Cut, kind: TensorKind, layer: np.ndarray | int, expert: np.ndarray | int,
               replica: int | None) -> Where | None:
        """Where `cut` puts the tensors of `kind` at `layer` / `expert` (arrays or ints); None: nowhere."""

    def placements(self, tensor: TensorSpec, replica: int | None = None) -> list[Placement]:
        kind = kind_of(self.model, tensor.role)
        out: list[Placement] = []
        for cut in self._cuts(kind):
            w = self._place(cut, kind, tensor.layer, tensor.expert, replica)
            if w is None:
                continue
            n = 1 if w.tensors is None else len(w.tensors)  # one entry per copy of this one tensor
            each = lambda x: np.broadcast_to(np.asarray(x, dtype=np.int64), (n,)).tolist()  # noqa: E731
            keys = list(zip(*map(each, w.keys))) if w.keys else [()] * n
            for key, first, slot in zip(keys, each(w.first), each(w.slot)):
                out += cut.placements(tensor.name, tensor.shape, w.group, w.name(*key), first, slot)
        return out

    def placement_table(self, index: np.ndarray | Sequence[int] | None = None,
                        replica: int | None = None) -> PlacementTable:
        c, b = self.model.canonical, TableBuilder()
        for entry, idx in entry_groups(self.model, index):
            kind = kind_of(self.model, entry.role)
            for cut in self._cuts(kind):
                w = self._place(cut, kind, c.layer[idx], c.expert[idx], replica)
                if w is not None:
                    canon = idx if w.tensors is None else idx[w.tensors]
                    cut.add_rows(b, self.model.tensor_name(int(idx[0])), entry.shape, w.group, canon, w.keys, w.name,
                                 w.first, w.slot)
        return b.table()

    def _check_cuts(self) -> None:
        """Raise LayoutError now, at construction, if a cut of this side cannot split its tensors."""
        c = self.model.canonical
        for entry, idx in entry_groups(self.model, None):
            kind = kind_of(self.model, entry.role)
            for cut in self._cuts(kind):
                w = self._place(cut, kind, int(c.layer[idx[0]]), int(c.expert[idx[0]]), 0)
                if w is not None:
                    cut.pieces(self.model.tensor_name(int(idx[0])), entry.shape, w.group)


def entry_groups(spec: ModelSpec, index: np.ndarray | Sequence[int] | None) -> Iterator[tuple[Entry, np.ndarray]]:
    """The canonical tensors `index` (default all) by family entry, in the order physical tensors are named."""
    c = spec.canonical
    index = np.arange(len(c), dtype=np.int64) if index is None else np.asarray(index, dtype=np.int64)
    codes = c.entry[index]
    order: dict[Hashable, int] = {r: k for k, r in enumerate(Role)}
    for e in c.entries:
        order.setdefault(e.role, len(order))
    by_code = index[np.argsort(codes, kind="stable")]
    ends = np.cumsum(np.bincount(codes, minlength=len(c.entries))).tolist()
    for code in sorted(range(len(c.entries)), key=lambda e: (order[c.entries[e].role], e)):
        start = ends[code - 1] if code else 0
        if ends[code] > start:
            yield c.entries[code], by_code[start:ends[code]]
