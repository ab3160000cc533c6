"""What a layout is: for each rank of one side, its physical tensors and where canonical boxes sit in them.

A `Placement` says: the box `canon_offset` + `lengths` of a canonical tensor sits on `rank`, in physical
tensor `tensor` (of shape `shape`) at `phys_offset`. The physical tensor may have more dimensions than the
canonical one (expert e of a [E_local, 2F, H] stack); the box's lengths then align with its trailing
dimensions and the leading dimensions have length 1. Padding is simply the part of a physical tensor that no
placement covers.
"""
from __future__ import annotations

import abc
import functools
from typing import ClassVar, Iterator, NamedTuple

from pydantic import BaseModel, ConfigDict

from ..errors import LayoutError
from .model import ModelSpec, TensorSpec


class Placement(NamedTuple):
    rank: int
    tensor: str
    shape: tuple[int, ...]
    canon_offset: tuple[int, ...]
    lengths: tuple[int, ...]
    phys_offset: tuple[int, ...]


class Layout(BaseModel, abc.ABC):
    """One side of a refit. Subclasses are small immutable declarations validated on construction."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: ClassVar[str]

    model: ModelSpec

    # --- structure -------------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def num_ranks(self) -> int:
        """Ranks of this side, numbered 0..num_ranks-1."""

    @property
    def num_replicas(self) -> int:
        """Identical copies of the whole layout; replica k's rank r is `r + k * ranks_per_replica`."""
        return 1

    @property
    def ranks_per_replica(self) -> int:
        return self.num_ranks // self.num_replicas

    @abc.abstractmethod
    def placements(self, tensor: TensorSpec, replica: int | None = None) -> list[Placement]:
        """Every place the canonical tensor lives; only in `replica` when given."""

    @abc.abstractmethod
    def rank_tensors(self, rank: int) -> dict[str, tuple[int, ...]]:
        """The physical tensors of one rank (name -> shape), padding included."""

    # --- conveniences ----------------------------------------------------------------------------
    @property
    def dtype(self) -> str:
        return self.model.dtype

    def iter_placements(self) -> Iterator[tuple[TensorSpec, Placement]]:
        for t in self.model.tensors:
            for p in self.placements(t):
                yield t, p

    def describe(self) -> str:
        return str(self)

    def _fail(self, constraint: str, fix: str = "", **values: object) -> None:
        raise LayoutError(self.kind, constraint, values, fix)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_ranks:
            raise LayoutError(self.kind, f"rank={rank} is outside [0, {self.num_ranks})", {"rank": rank})


def divisible(layout: Layout, what: str, value: int, by_name: str, by: int) -> None:
    """Raise the layout's error 'what=value is not divisible by by_name=by' unless it is."""
    if by <= 0 or value % by:
        layout._fail(f"{what}={value} is not divisible by {by_name}={by}", **{what: value, by_name: by})


def positive(layout: Layout, **values: int) -> None:
    for name, value in values.items():
        if value < 1:
            layout._fail(f"{name}={value} must be at least 1", **{name: value})


def pad_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@functools.lru_cache(maxsize=16)
def rank_tensor_table(layout: Layout) -> dict[int, dict[str, tuple[int, ...]]]:
    """rank -> {physical tensor name: shape}, read off the placements (layouts emit an empty placement
    for a physical tensor that holds only padding, so it still appears here)."""
    table: dict[int, dict[str, tuple[int, ...]]] = {}
    for _, p in layout.iter_placements():
        table.setdefault(p.rank, {})[p.tensor] = p.shape
    return table
