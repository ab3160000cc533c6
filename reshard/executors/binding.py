"""Which process plays which rank of a plan.

A plan numbers its source ranks 0..S-1 and its destination ranks 0..D-1, abstractly. A `Binding` ties them to
the processes that run a refit: `src[s]` is the process playing source rank s, `dst[d]` the process playing
destination rank d (process numbers are 0..P-1 within the refit, not global ranks of a larger world).

- disjoint: trainer and inference are different processes (`Binding.disjoint`);
- colocated: process d is both source rank d and destination rank d (`Binding.colocated`);
- anything else: spell the two tuples out. One process may play several ranks of either side; bytes between
  ranks of one process are local copies, never a transfer to itself.

A small immutable value, validated on construction and against a plan with `check`. (The same type as the
torch.distributed executor's binding: one binding describes a refit whatever moves the bytes.)
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from ..errors import ExecutionError


@dataclass(frozen=True)
class Binding:
    src: tuple[int, ...]  # src[s] = process playing source rank s
    dst: tuple[int, ...]  # dst[d] = process playing destination rank d

    def __post_init__(self) -> None:
        for side in ("src", "dst"):
            ranks = tuple(getattr(self, side))
            bad = [r for r in ranks if not isinstance(r, int) or isinstance(r, bool) or r < 0]
            if bad:
                raise ExecutionError(f"binding {side} must list non-negative process numbers; got {bad[:5]}")
            object.__setattr__(self, side, tuple(int(r) for r in ranks))

    @classmethod
    def disjoint(cls, num_src: int, num_dst: int, first: int = 0) -> "Binding":
        """Sources on processes first..first+S-1, destinations on the next D processes."""
        return cls(tuple(range(first, first + num_src)), tuple(range(first + num_src, first + num_src + num_dst)))

    @classmethod
    def colocated(cls, num_src: int, num_dst: int) -> "Binding":
        """Source rank s on process s and destination rank d on process d: process d plays both."""
        return cls(tuple(range(num_src)), tuple(range(num_dst)))

    @property
    def processes(self) -> tuple[int, ...]:
        """Every process that plays some rank, sorted."""
        return tuple(sorted(set(self.src) | set(self.dst)))

    @property
    def num_processes(self) -> int:
        return max(self.processes, default=-1) + 1

    def src_ranks_of(self, process: int) -> tuple[int, ...]:
        return tuple(s for s, p in enumerate(self.src) if p == process)

    def dst_ranks_of(self, process: int) -> tuple[int, ...]:
        return tuple(d for d, p in enumerate(self.dst) if p == process)

    def check(self, num_src: int, num_dst: int, group_size: int | None = None) -> None:
        """Raise ExecutionError unless this binding places every rank of a plan with these rank counts."""
        problems = []
        if len(self.src) != num_src:
            problems.append(f"the plan has {num_src} source ranks, the binding places {len(self.src)}")
        if len(self.dst) != num_dst:
            problems.append(f"the plan has {num_dst} destination ranks, the binding places {len(self.dst)}")
        if group_size is not None and self.processes and self.processes[-1] >= group_size:
            problems.append(f"the binding uses process {self.processes[-1]} but only {group_size} take part")
        if problems:
            raise ExecutionError("binding does not fit the plan:\n  - " + "\n  - ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        return {"src": list(self.src), "dst": list(self.dst)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Binding":
        return cls(tuple(d["src"]), tuple(d["dst"]))

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict()).encode()).hexdigest()

    def __str__(self) -> str:
        return f"Binding(src={list(self.src)}, dst={list(self.dst)})"
