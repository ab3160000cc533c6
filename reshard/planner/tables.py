"""The physical tensors one side of a plan touches (TensorTable), and the saved plan format's version."""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

FORMAT_VERSION = 2


def frozen_ints(a: Any) -> np.ndarray:
    """`a` as a contiguous, read-only int64 array."""
    a = np.ascontiguousarray(a, dtype=np.int64)
    a.setflags(write=False)
    return a


@dataclass(frozen=True, eq=False)
class TensorTable:
    """The physical tensors one side of a plan touches: id -> (rank, name, shape).

    Stored as a rank and a kind per id (a side of a thousand ranks has hundreds of thousands of tensors);
    `ranks`, `names` and `shapes` are built on first use.

    Attributes:
        rank: per tensor id, its rank.
        kind: per tensor id, its index in `kinds`.
        kinds: the distinct (name, shape) pairs. Shapes are in units of the plan's dtype: a float32 tensor of a
            bfloat16 plan has twice its elements in its last dimension.
        dtypes: per kind, the dtype of a tensor kept in its own dtype ("" = the plan's); empty when none is.
    """

    rank: np.ndarray
    kind: np.ndarray
    kinds: tuple[tuple[str, tuple[int, ...]], ...]
    dtypes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("rank", "kind"):
            object.__setattr__(self, name, frozen_ints(getattr(self, name)))
        object.__setattr__(self, "kinds", tuple(self.kinds))  # (name, shape tuple) pairs
        object.__setattr__(self, "dtypes", tuple(self.dtypes) if any(self.dtypes) else ())

    def __len__(self) -> int:
        return len(self.rank)

    @functools.cached_property
    def ranks(self) -> tuple[int, ...]:
        """The rank of every tensor id."""
        return tuple(self.rank.tolist())

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        """The name of every tensor id."""
        return tuple(self.kinds[k][0] for k in self.kind.tolist())

    @functools.cached_property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shape of every tensor id (in plan units)."""
        return tuple(self.kinds[k][1] for k in self.kind.tolist())

    def name(self, tid: int) -> str:
        """Tensor `tid`'s name, without building `names`."""
        return self.kinds[int(self.kind[tid])][0]

    def shape(self, tid: int) -> tuple[int, ...]:
        """Tensor `tid`'s shape (in plan units), without building `shapes`."""
        return self.kinds[int(self.kind[tid])][1]

    def find(self, ranks: np.ndarray, names: Sequence[str]) -> np.ndarray:
        """The id of the tensor named names[i] on rank ranks[i], -1 where there is none (one search, not a loop)."""
        ids: dict[str, int] = {}
        kind_name = np.asarray([ids.setdefault(n, len(ids)) for n, _ in self.kinds] or [0], dtype=np.int64)
        want_name = np.asarray([ids.get(n, -1) for n in names], dtype=np.int64)
        if not len(self.rank):
            return np.full(len(want_name), -1, dtype=np.int64)
        key = self.rank * (len(ids) + 1) + kind_name[self.kind]
        want = np.asarray(ranks, dtype=np.int64) * (len(ids) + 1) + want_name
        order = np.argsort(key, kind="stable")
        at = order[np.minimum(np.searchsorted(key[order], want), len(key) - 1)]
        return np.where((want_name >= 0) & (key[at] == want), at, -1)

    def numel(self) -> np.ndarray:
        """Elements of every tensor id (in plan units)."""
        return self.kind_array(lambda _, shape: math.prod(shape))

    def kind_array(self, f) -> np.ndarray:
        """f(name, shape) per tensor id, computed once per kind."""
        per_kind = np.asarray([f(n, s) for n, s in self.kinds], dtype=np.int64)
        return per_kind[self.kind] if len(self.kind) else np.zeros(0, np.int64)

    def own_dtypes(self) -> dict[tuple[int, str], str]:
        """(rank, name) -> dtype of the tensors kept in their own dtype (empty for almost every plan)."""
        if not self.dtypes:
            return {}
        own = np.flatnonzero(np.asarray([bool(d) for d in self.dtypes])[self.kind])
        return {(int(self.rank[i]), self.name(int(i))): self.dtypes[int(self.kind[i])] for i in own}

    def on_rank(self, rank: int) -> dict[str, tuple[int, ...]]:
        """Name -> shape (in plan units) of the tensors on `rank`."""
        return {self.kinds[k][0]: self.kinds[k][1] for k in self.kind[self.rank == rank].tolist()}

    def tiled(self, copies: int, rank_step: int) -> "TensorTable":
        """The table repeated `copies` times, copy c on ranks shifted by c * rank_step (identical replicas)."""
        rank = (self.rank[None, :] + rank_step * np.arange(copies)[:, None]).ravel()
        return TensorTable(rank, np.tile(self.kind, copies), self.kinds, self.dtypes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values, as a saved plan holds them."""
        out = {"rank": self.rank.tolist(), "kind": self.kind.tolist(), "kinds": [[n, list(s)] for n, s in self.kinds]}
        if self.dtypes:
            out["dtypes"] = list(self.dtypes)
        return out

    def digest_update(self, h) -> None:
        """Feed the table to hash `h` (part of `Plan.digest`)."""
        h.update(json.dumps(self.kinds).encode())
        if self.dtypes:  # absent from one-dtype plans, whose digests stay as they were
            h.update(json.dumps(self.dtypes).encode())
        h.update(self.rank.astype("<i8").tobytes())
        h.update(self.kind.astype("<i8").tobytes())
