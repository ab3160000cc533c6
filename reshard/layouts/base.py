"""What a layout is: for each rank of one side, its physical tensors and where canonical boxes sit in them.

A physical tensor may have more dimensions than the canonical one (expert e of an [E_local, 2F, H] stack): the
box's lengths align with its trailing dimensions. Padding is the part no placement covers."""
from __future__ import annotations

import abc
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, NamedTuple, Sequence

import numpy as np
from pydantic import ConfigDict, field_validator

from ..arrays import unique_inverse
from ..errors import LayoutError, LimitError, show
from ..limits import MAX_RANKS
from .model import ModelSpec, TensorSpec
from .validated import ValidatedModel


class Placement(NamedTuple):
    """Where one box of a canonical tensor sits on one rank.

    Attributes:
        rank: the rank holding the box.
        tensor: the physical tensor's name on that rank.
        shape: the physical tensor's shape (padding included).
        canon_offset: the box's first element in the canonical tensor.
        lengths: the box's extent per dimension.
        phys_offset: the box's first element in the physical tensor.
    """

    rank: int
    tensor: str
    shape: tuple[int, ...]
    canon_offset: tuple[int, ...]
    lengths: tuple[int, ...]
    phys_offset: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class PlacementTable:
    """Many placements as columns: row i puts canonical tensor `canon[i]`'s 2-D box (`c0`, `c1`) + (`n0`, `n1`)
    on `rank[i]`, in physical tensor `kinds[kind[i]]` = (name, shape), from flat element `origin[i]`, rows
    `stride[i]` apart. A 1-D canonical tensor is one row."""

    canon: np.ndarray
    rank: np.ndarray
    kind: np.ndarray
    c0: np.ndarray
    c1: np.ndarray
    n0: np.ndarray
    n1: np.ndarray
    origin: np.ndarray
    stride: np.ndarray
    kinds: tuple[tuple[str, tuple[int, ...]], ...]

    COLUMNS: ClassVar[tuple[str, ...]] = ("canon", "rank", "kind", "c0", "c1", "n0", "n1", "origin", "stride")

    def __len__(self) -> int:
        return len(self.canon)


class TableBuilder:
    """Accumulates blocks of placement rows; each block's columns broadcast against each other."""

    def __init__(self) -> None:
        self._kinds: dict[tuple[str, tuple[int, ...]], int] = {}
        self._blocks: list[list[np.ndarray]] = []

    def kind(self, name: str, shape: tuple[int, ...]) -> int:
        """The kind id of the physical tensor (name, shape), a new one at first sight."""
        return self._kinds.setdefault((name, tuple(shape)), len(self._kinds))

    def kinds_for(self, keys: Sequence[np.ndarray | int], name: Callable[..., str], shape: tuple[int, ...]
                  ) -> np.ndarray:
        """Kind id per tensor of one `shape`, named `name(*key)` from the key columns `keys` (once per key)."""
        cols = [c.reshape(-1) for c in np.broadcast_arrays(*(np.asarray(k, dtype=np.int64) for k in keys))]
        first, inverse = unique_inverse(tuple(cols))
        kinds, shape = self._kinds, tuple(shape)
        ids = [kinds.setdefault((name(*key), shape), len(kinds)) for key in zip(*(c[first].tolist() for c in cols))]
        return np.asarray(ids, dtype=np.int64)[inverse]

    def add(self, canon, rank, kind, c0, c1, n0, n1, origin, stride) -> None:
        """A block of rows, one argument per `PlacementTable` column (arrays or scalars, broadcast together)."""
        arrays = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64)
                                       for x in (canon, rank, kind, c0, c1, n0, n1, origin, stride)))
        self._blocks.append(arrays)  # broadcast views: written once, into the table's columns

    def add_placements(self, canon: int, placements: Sequence["Placement"]) -> None:
        """Rows from reference placements (the slow path)."""
        if placements:
            rows = [(canon, p.rank, self.kind(p.tensor, p.shape), *sum(as_2d(p.canon_offset, p.lengths), ()),
                     np.ravel_multi_index(p.phys_offset, p.shape), p.shape[-1]) for p in placements]
            self._blocks.append(list(np.asarray(rows, dtype=np.int64).T))

    def table(self) -> PlacementTable:
        """Every block added, in order, as one table."""
        n = sum(b[0].size for b in self._blocks)
        cols = [np.empty(n, dtype=np.int64) for _ in range(9)]
        at = 0
        for block in self._blocks:
            size = block[0].size
            for col, x in zip(cols, block):
                col[at: at + size].reshape(x.shape)[...] = x
            at += size
        return PlacementTable(*cols, kinds=tuple(self._kinds))


def as_2d(offset: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[tuple[int, int], tuple[int, int]]:
    """A canonical box seen as 2-D: a 1-D box is one row; an N-D box in the [prod(dims[:-1]), last] view."""
    if len(offset) == 1:
        return (0, offset[0]), (1, lengths[0])
    if len(offset) == 2:
        return (offset[0], offset[1]), (lengths[0], lengths[1])
    if any(offset[1:-1]):
        raise LayoutError("layout", f"a box at {offset} of a {len(offset)}-D tensor cuts a middle dimension; only "
                          f"dim 0 and the last dimension may be cut", {"offset": offset, "lengths": lengths})
    middle = math.prod(lengths[1:-1])
    return (offset[0] * middle, offset[-1]), (lengths[0] * middle, lengths[-1])


class Layout(ValidatedModel, abc.ABC):
    """One side of a refit: for each rank, its physical tensors and where canonical boxes sit in them.

    Subclasses are immutable declarations validated on construction, read through `placements` /
    `placement_table` and `rank_tensors`; each names its `engine` and, for a refit destination, its `installs`.

    Args:
        model: the model whose tensors the layout places.

    Raises:
        LayoutError: a field breaks a rule of the layout (the message names field, value and rule).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    engine: ClassVar[str]
    installs: ClassVar[tuple[str, ...]] = ()  # how a refit may land on this layout; (): not a refit destination

    model: ModelSpec

    @field_validator("model", mode="before")
    @classmethod
    def _model_fields_by_name(cls, value: Any) -> Any:
        """A ModelSpec, or its fields by name (pydantic would spread any other mapping as keyword arguments)."""
        if isinstance(value, dict) and not all(isinstance(k, str) for k in value):
            raise LayoutError(getattr(cls, "engine", "layout"), f"model={show(value)} must be a ModelSpec or its "
                                                               f"fields by name", {"model": value})
        return value

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
        """Ranks of one replica."""
        return self.num_ranks // self.num_replicas

    @abc.abstractmethod
    def placements(self, tensor: TensorSpec, replica: int | None = None) -> list[Placement]:
        """Every place the canonical tensor lives; only in `replica` when given."""

    def rank_tensors(self, rank: int) -> dict[str, tuple[int, ...]]:
        """The physical tensors of one rank (name -> shape), padding included."""
        self._check_rank(rank)
        return rank_tensor_table(self).get(rank, {})

    def placement_table(self, index: np.ndarray | Sequence[int] | None = None,
                        replica: int | None = None) -> PlacementTable:
        """`placements` of the canonical tensors `index` (default all) as one table (here one at a time)."""
        tensors = self.model.tensors
        index = range(len(tensors)) if index is None else np.asarray(index, dtype=np.int64).tolist()
        b = TableBuilder()
        for k in index:
            b.add_placements(k, self.placements(tensors[k], replica))
        return b.table()

    def expert_stacks(self, replica: int = 0) -> Any:
        """An expert-parallel vLLM engine's `ExpertStacks` of `replica`, for the planner's slot proof; None here."""
        return None

    def value_offset(self, tensor: TensorSpec) -> float:
        """This layout stores canonical value v as v + value_offset (a zero-centred norm: -1); plans add it."""
        return 0.0

    @property
    def dtype(self) -> str:
        """The model's dtype: every physical tensor's, except those `tensor_dtypes` names."""
        return self.model.dtype

    def tensor_dtypes(self) -> dict[tuple[int, str], str]:
        """(rank, physical tensor name) -> dtype of the physical tensors not in `dtype` (`own_dtype_tensors`)."""
        return _own_dtypes(self)

    def tensor_dtype(self, rank: int, name: str) -> str:
        """The dtype of one physical tensor: its own (`tensor_dtypes`), else the layout's."""
        return _own_dtypes(self).get((rank, name), self.dtype)

    def _fail(self, constraint: str, fix: str = "", **values: object) -> None:
        raise LayoutError(self.engine, constraint, values, fix)

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.num_ranks:
            raise LayoutError(self.engine, f"rank={rank} is outside [0, {self.num_ranks})", {"rank": rank})


def divisible(layout: Layout, what: str, value: int, by_name: str, by: int, blame: str = "") -> None:
    """Raise the layout's error 'what=value is not divisible by by_name=by' unless it is, blaming field `blame`
    ("what": `what`; default: `by_name`, the layout's option)."""
    if by <= 0 or value % by:
        values = {what: value, by_name: by} if blame == "what" else {blame or by_name: by, what: value}
        layout._fail(f"{what}={value} is not divisible by {by_name}={by}", **values)


def positive(layout: Layout, **values: int) -> None:
    """Raise the layout's error unless every value is at least 1."""
    for name, value in values.items():
        if value < 1:
            layout._fail(f"{name}={value} must be at least 1", **{name: value})


def bounded(layout: Layout, limit: int, what: str, **values: int) -> None:
    """Refuse counts no real cluster has (reshard.limits), before anything is allocated for them."""
    for name, value in values.items():
        if value > limit:
            raise LimitError(name, value, limit, what, where=layout.engine)


class WholePerReplica:
    """For layouts holding every tensor whole on one rank per replica (declare `replicas`, call `_check_replicas`)."""

    def _check_replicas(self) -> None:
        positive(self, replicas=self.replicas)
        bounded(self, MAX_RANKS, "ranks", replicas=self.replicas)

    @property
    def num_ranks(self) -> int:
        """One rank per replica."""
        return self.replicas

    @property
    def num_replicas(self) -> int:
        """The `replicas` field."""
        return self.replicas

    def __str__(self) -> str:
        return f"{self.engine}:replicas={self.replicas}"


def pad_to(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple of `multiple`."""
    return -(-n // multiple) * multiple


@functools.lru_cache(maxsize=16)
def rank_tensor_table(layout: Layout) -> dict[int, dict[str, tuple[int, ...]]]:
    """rank -> {physical tensor name: shape}, read off the placements (a padding-only tensor has an empty one)."""
    t = layout.placement_table()
    pairs = np.unique(np.stack([t.rank, t.kind]), axis=1) if len(t) else np.zeros((2, 0), np.int64)
    table: dict[int, dict[str, tuple[int, ...]]] = {}
    for rank, kind in pairs.T.tolist():
        name, shape = t.kinds[kind]
        table.setdefault(rank, {})[name] = shape
    return table


@functools.lru_cache(maxsize=16)
def _own_dtypes(layout: Layout) -> dict[tuple[int, str], str]:
    out: dict[tuple[int, str], str] = {}
    for t in layout.model.own_dtype_tensors:
        for p in layout.placements(t):
            if out.setdefault((p.rank, p.tensor), t.dtype) != t.dtype:
                raise LayoutError(layout.engine, f"rank {p.rank} tensor {p.tensor!r} would hold both "
                                  f"{out[(p.rank, p.tensor)]} and {t.dtype} data", {"tensor": p.tensor})
    return out
