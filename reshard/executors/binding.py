"""Which process plays which rank of a plan.

`Binding.src[s]` is the refit group's rank playing source rank s, `dst[d]` the one playing destination rank d
(group ranks, not global ones). `disjoint`: different processes; `colocated`: one process plays a trainer and an
inference rank; anything else spelled out. Bytes between ranks of one process are local copies.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import ArgumentError, ExecutionError


@dataclass(frozen=True)
class Binding:
    """Which process of the refit group plays each plan rank.

    Attributes:
        src: src[s] is the group rank playing source rank s.
        dst: dst[d] is the group rank playing destination rank d.
    """

    src: tuple[int, ...]  # src[s] = group rank playing source rank s
    dst: tuple[int, ...]  # dst[d] = group rank playing destination rank d

    def __post_init__(self) -> None:
        for side in ("src", "dst"):
            if not isinstance(getattr(self, side), (list, tuple, range)):
                raise ArgumentError(side, getattr(self, side), "must be a list or tuple of group ranks")
            ranks = tuple(getattr(self, side))
            if not ranks:
                raise ArgumentError(side, getattr(self, side), "must list the group rank of at least one plan rank")
            bad = [r for r in ranks if not isinstance(r, int) or isinstance(r, bool) or r < 0]
            if bad:
                raise ExecutionError(f"binding {side} must list non-negative group ranks; got {bad[:5]}")
            object.__setattr__(self, side, tuple(int(r) for r in ranks))

    # --- common shapes ---------------------------------------------------------------------------
    @classmethod
    def disjoint(cls, num_src: int, num_dst: int, first: int = 0) -> "Binding":
        """Sources on group ranks first..first+S-1, destinations on the next D ranks."""
        return cls(tuple(range(first, first + num_src)), tuple(range(first + num_src, first + num_src + num_dst)))

    @classmethod
    def colocated(cls, num_src: int, num_dst: int, colocation: "Sequence[int] | None" = None) -> "Binding":
        """Source rank s on group rank s; destination rank d on group rank d, or with `colocation` (a plan's:
        the source rank on each destination rank's device) on the process of that source rank."""
        dst = tuple(range(num_dst)) if colocation is None else tuple(int(r) for r in colocation)
        return cls(tuple(range(num_src)), dst)

    # --- queries ---------------------------------------------------------------------------------
    @property
    def processes(self) -> tuple[int, ...]:
        """Every group rank that plays some rank, sorted."""
        return tuple(sorted(set(self.src) | set(self.dst)))

    @property
    def num_processes(self) -> int:
        """How many group ranks the refit needs: one past the highest group rank this binding uses."""
        return max(self.processes, default=-1) + 1

    def src_ranks_of(self, process: int) -> tuple[int, ...]:
        """The source ranks that group rank `process` plays, ascending."""
        return tuple(s for s, p in enumerate(self.src) if p == process)

    def dst_ranks_of(self, process: int) -> tuple[int, ...]:
        """The destination ranks that group rank `process` plays, ascending."""
        return tuple(d for d, p in enumerate(self.dst) if p == process)

    def check(self, num_src: int, num_dst: int, group_size: int | None = None) -> None:
        """Raise ExecutionError unless this binding places every rank of a plan with these rank counts."""
        problems = []
        if len(self.src) != num_src:
            problems.append(f"the plan has {num_src} source ranks, the binding places {len(self.src)}")
        if len(self.dst) != num_dst:
            problems.append(f"the plan has {num_dst} destination ranks, the binding places {len(self.dst)}")
        if group_size is not None and self.processes and self.processes[-1] >= group_size:
            problems.append(f"the binding uses group rank {self.processes[-1]} but the group has {group_size} "
                            f"ranks (binding ranks are ranks in the refit group, not global ranks)")
        if problems:
            raise ExecutionError("binding does not fit the plan:\n  - " + "\n  - ".join(problems))

    # --- identity --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """This binding as JSON-ready lists (inverse of `from_dict`)."""
        return {"src": list(self.src), "dst": list(self.dst)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Binding":
        """The binding `to_dict` wrote."""
        return cls(tuple(d["src"]), tuple(d["dst"]))

    @property
    def digest(self) -> str:
        """SHA-256 (hex) of `to_dict`'s JSON: part of the fingerprint the ranks compare before a refit."""
        return hashlib.sha256(json.dumps(self.to_dict()).encode()).hexdigest()

    def __str__(self) -> str:
        return f"Binding(src={list(self.src)}, dst={list(self.dst)})"
