"""The plan: columnar copy operations plus the tables and accounting that give them meaning.

An op copies a 2-D strided block: `rows` x `cols` elements from the source tensor's flat storage at
`src_offset` (row stride `src_stride`) to the destination tensor's flat storage at `dst_offset` (row stride
`dst_stride`). A contiguous run is `rows == 1`.

Fan-out: an op with `src_side == 1` is a relay: its source is destination rank `src_rank`'s tensor
`src_tensor` (an id in the destination table), which that rank received in an earlier stage. `stage` orders
execution: every op of stage s may start only once the ops of stages < s that write its source are done.
Plain plans have every op at stage 0, side 0.

Ops are sorted by (stage, src_side, src_rank, dst_rank, src_tensor, dst_tensor, src_offset), so the ops of
one (stage, sender, receiver) -- a transfer -- are one contiguous range.

Plans are saved as one `.npz` (plain arrays plus a JSON header; loaded with allow_pickle=False) or as JSON.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import numpy as np

from ..errors import PlanError
from ..layouts import Layout, layout_from_dict, layout_to_dict
from ..layouts.model import DTYPE_SIZES
from .accounting import Accounting, Bounds, account

OP_COLUMNS = ("stage", "src_side", "src_rank", "src_tensor", "src_offset", "src_stride", "dst_rank", "dst_tensor",
              "dst_offset", "dst_stride", "rows", "cols", "canon")
SOURCE, RELAY = 0, 1  # values of src_side
FORMAT_VERSION = 1


@dataclass(frozen=True)
class TensorTable:
    """The physical tensors one side of a plan touches: id -> (rank, name, shape)."""

    ranks: tuple[int, ...]
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    def __len__(self) -> int:
        return len(self.names)

    def on_rank(self, rank: int) -> dict[str, tuple[int, ...]]:
        return {n: s for r, n, s in zip(self.ranks, self.names, self.shapes) if r == rank}

    def to_dict(self) -> dict[str, Any]:
        return {"ranks": list(self.ranks), "names": list(self.names), "shapes": [list(s) for s in self.shapes]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TensorTable":
        return cls(tuple(d["ranks"]), tuple(d["names"]), tuple(tuple(s) for s in d["shapes"]))


class Transfer(NamedTuple):
    stage: int
    src_side: int  # SOURCE: a source-layout rank sends; RELAY: a destination rank forwards what it received
    src_rank: int
    dst_rank: int
    start: int  # first op
    stop: int  # one past the last op
    nbytes: int


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.int64)
    a.setflags(write=False)
    return a


@dataclass(frozen=True)
class Plan:
    src: Layout
    dst: Layout
    src_tensors: TensorTable
    dst_tensors: TensorTable
    ops: dict[str, np.ndarray]
    bounds: Bounds
    colocated: bool = False
    fanout: int | None = None
    selection: tuple[str, ...] | None = None  # canonical tensor names, None = whole model
    coverage: str = "exact"
    compile_seconds: float = 0.0
    digest: str = field(default="")
    accounting: Accounting = field(init=False, repr=False)

    def __post_init__(self) -> None:
        missing = [c for c in OP_COLUMNS if c not in self.ops]
        if missing:
            raise PlanError("plan ops are missing columns", missing)
        object.__setattr__(self, "ops", {c: _frozen(self.ops[c]) for c in OP_COLUMNS})
        if not self.digest:
            object.__setattr__(self, "digest", self._compute_digest())
        object.__setattr__(self, "accounting", account(self.ops, self.itemsize, self.src.num_ranks,
                                                       self.dst.num_ranks, self.colocated, self.bounds))

    # --- shape of the plan -----------------------------------------------------------------------
    @property
    def num_ops(self) -> int:
        return int(self.ops["rows"].shape[0])

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dst.dtype]

    def op_bytes(self) -> np.ndarray:
        return self.ops["rows"] * self.ops["cols"] * self.itemsize

    @property
    def transfers(self) -> list[Transfer]:
        return list(self._iter_transfers())

    def _iter_transfers(self) -> Iterator[Transfer]:
        st, side, s, d = (self.ops[c] for c in ("stage", "src_side", "src_rank", "dst_rank"))
        if not len(s):
            return
        change = (s[1:] != s[:-1]) | (d[1:] != d[:-1]) | (st[1:] != st[:-1]) | (side[1:] != side[:-1])
        cut = np.flatnonzero(change) + 1
        starts = np.concatenate([[0], cut])
        stops = np.concatenate([cut, [len(s)]])
        nbytes = np.add.reduceat(self.op_bytes(), starts)
        for a, b, n in zip(starts.tolist(), stops.tolist(), nbytes.tolist()):
            yield Transfer(int(st[a]), int(side[a]), int(s[a]), int(d[a]), a, b, n)

    @property
    def num_stages(self) -> int:
        return int(self.ops["stage"].max()) + 1 if self.num_ops else 0

    def ops_for_src(self, rank: int) -> np.ndarray:
        """Indices of the ops rank `rank` of the source side sends (relays excluded)."""
        return np.flatnonzero((self.ops["src_rank"] == rank) & (self.ops["src_side"] == SOURCE))

    def ops_relayed_by(self, rank: int) -> np.ndarray:
        """Indices of the ops destination rank `rank` forwards to other destination ranks."""
        return np.flatnonzero((self.ops["src_rank"] == rank) & (self.ops["src_side"] == RELAY))

    def ops_for_dst(self, rank: int) -> np.ndarray:
        return np.flatnonzero(self.ops["dst_rank"] == rank)

    def op(self, i: int) -> dict[str, Any]:
        """One op, readable: tensor names instead of ids."""
        row = {c: int(self.ops[c][i]) for c in OP_COLUMNS}
        table = self.src_tensors if row["src_side"] == SOURCE else self.dst_tensors
        row["src_tensor"] = table.names[row["src_tensor"]]
        row["dst_tensor"] = self.dst_tensors.names[row["dst_tensor"]]
        row["canon"] = self.src.model.tensors[row["canon"]].name
        return row

    # --- identity --------------------------------------------------------------------------------
    def _header(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "src": layout_to_dict(self.src),
            "dst": layout_to_dict(self.dst),
            "colocated": self.colocated,
            "fanout": self.fanout,
            "selection": list(self.selection) if self.selection is not None else None,
            "src_tensors": self.src_tensors.to_dict(),
            "dst_tensors": self.dst_tensors.to_dict(),
            "bounds": self.bounds.to_dict(),
        }

    def _compute_digest(self) -> str:
        h = hashlib.sha256(json.dumps(self._header(), sort_keys=True).encode())
        for c in OP_COLUMNS:
            h.update(c.encode())
            h.update(self.ops[c].astype("<i8").tobytes())
        return h.hexdigest()

    # --- persistence (never pickle) --------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {**self._header(), "coverage": self.coverage, "compile_seconds": self.compile_seconds,
                "digest": self.digest, "ops": {c: self.ops[c].tolist() for c in OP_COLUMNS}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        return cls._build(d, {c: np.asarray(d["ops"][c], dtype=np.int64) for c in OP_COLUMNS})

    def save(self, path: str | Path) -> Path:
        """Write `path` as .json (everything as JSON) or .npz (op columns as arrays, header as JSON)."""
        path = Path(path)
        if path.suffix == ".json":
            path.write_text(json.dumps(self.to_dict()))
            return path
        header = {**self._header(), "coverage": self.coverage, "compile_seconds": self.compile_seconds,
                  "digest": self.digest}
        arrays = {c: self.ops[c] for c in OP_COLUMNS}
        arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
        with open(path, "wb") as f:
            np.savez_compressed(f, **arrays)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        path = Path(path)
        if path.suffix == ".json":
            return cls.from_dict(json.loads(path.read_text()))
        with np.load(path, allow_pickle=False) as z:
            header = json.loads(bytes(z["header"]).decode())
            ops = {c: z[c] for c in OP_COLUMNS}
        return cls._build(header, ops)

    @classmethod
    def _build(cls, d: dict[str, Any], ops: dict[str, np.ndarray]) -> "Plan":
        if d.get("format") != FORMAT_VERSION:
            raise PlanError(f"plan format {d.get('format')!r} is not supported (expected {FORMAT_VERSION})")
        src, dst = layout_from_dict(d["src"]), layout_from_dict(d["dst"])
        plan = cls(src=src, dst=dst, src_tensors=TensorTable.from_dict(d["src_tensors"]),
                   dst_tensors=TensorTable.from_dict(d["dst_tensors"]), ops=ops,
                   bounds=Bounds.from_dict(d["bounds"]), colocated=d["colocated"], fanout=d.get("fanout"),
                   selection=tuple(d["selection"]) if d["selection"] is not None else None,
                   coverage=d["coverage"], compile_seconds=d["compile_seconds"])
        if d.get("digest") and plan.digest != d["digest"]:
            raise PlanError(f"plan digest mismatch: stored {d['digest'][:12]}, content {plan.digest[:12]}")
        return plan

    def __str__(self) -> str:
        from .report import summary

        return summary(self)
