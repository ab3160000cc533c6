"""The plan: columnar copy operations plus the tables and accounting that give them meaning.

An op copies a 2-D strided block: `rows` x `cols` elements from the source tensor's flat storage at `src_offset`
(row stride `src_stride`) to the destination tensor's at `dst_offset` (row stride `dst_stride`); a contiguous run
has `rows == 1`. An op with `src_side == RELAY` reads destination rank `src_rank`'s tensor `src_tensor`, received
in an earlier `stage` (fan-out); plans without fan-out have every op at stage 0, side SOURCE.

`plan.ops` holds every op as a row of OP_COLUMNS, sorted so that the ops of one (stage, sender, receiver), a
transfer, are one contiguous range. The plan stores them factored by destination replica (planner.program) and
expands them on first use; an executor expands only its own rank's rows (`ops_sent_by`, `ops_received_by`).
Plans are saved as `.npz` (plain arrays and a JSON header, loaded without pickle) or as JSON.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..arguments import PLAN_SUFFIXES, output_path
from ..errors import PlanError
from ..layouts import Layout, layout_to_dict
from ..layouts.model import DTYPE_SIZES
from .accounting import Accounting, Bounds, account_program
from .program import OP_COLUMNS, RELAY, SOURCE, Program, check_program, expand
from .tables import FORMAT_VERSION, TensorTable

class Transfer(NamedTuple):
    """One message of a plan: the contiguous range of its ops that one rank sends another in one stage.

    Attributes:
        stage: the fan-out stage.
        src_side: SOURCE (a source rank sends) or RELAY (a destination rank forwards what it received).
        src_rank: the sender, on the side `src_side` names.
        dst_rank: the receiving destination rank.
        start: the first op's row in `Plan.ops`.
        stop: one past the last op's row.
        nbytes: the bytes its ops move.
    """

    stage: int
    src_side: int
    src_rank: int
    dst_rank: int
    start: int
    stop: int
    nbytes: int


@dataclass(frozen=True)
class Plan:
    """A compiled refit: every block copy from source ranks to destination ranks, proven to cover exactly.

    Made by `reshard.compile`, saved and loaded (re-proved) with `save` / `load`, run by an executor
    (`reshard.executors.make_executor`); `accounting` counts its bytes, `digest` identifies it across processes.

    Args:
        src: the source layout.
        dst: the destination layout.
        src_tensors: the source ranks' physical tensors.
        dst_tensors: the destination ranks' physical tensors.
        program: the ops, as columns.
        bounds: per-tensor extents the ops were checked against.
        colocation: per destination rank, the source rank on its device (None: none).
        fanout: relay tree width across replicas (None: the source feeds every replica).
        roots: replicas the source feeds when `fanout` is set.
        selection: the canonical tensors of a subset plan (None: the whole model).
        coverage: "exact" once proven.
        compile_seconds: time the compiler took.
        digest: content digest (set by the compiler and required on load).

    Raises:
        PlanFileError: from `load` / `from_dict`, for a malformed plan or one that does not prove its claims.
    """

    src: Layout
    dst: Layout
    src_tensors: TensorTable
    dst_tensors: TensorTable
    program: Program
    bounds: Bounds
    colocation: tuple[int, ...] | None = None
    fanout: int | None = None
    roots: int | None = None
    selection: tuple[str, ...] | None = None
    coverage: str = "exact"
    compile_seconds: float = 0.0
    digest: str = field(default="")
    accounting: Accounting = field(init=False, repr=False)

    def __post_init__(self) -> None:
        check_program(self)  # every index inside what it indexes, before anything is computed from them
        if self.colocation is not None:
            object.__setattr__(self, "colocation", tuple(int(r) for r in self.colocation))
        if not self.digest:
            object.__setattr__(self, "digest", self._compute_digest())
        object.__setattr__(self, "accounting", account_program(self.program, self.itemsize, self.src.num_ranks,
                                                               self.dst.num_ranks, self.colocation, self.bounds))

    @functools.cached_property
    def value_shifts(self) -> dict[int, float]:
        """Canonical tensor index -> what executors add to every destination element of it after copying
        (dst.value_offset - src.value_offset; e.g. +1 for a norm Megatron keeps zero-centred and HF plain).
        Empty for almost every plan."""
        names = set(self.selection) if self.selection is not None else None
        shifts = {t.index: self.dst.value_offset(t) - self.src.value_offset(t) for t in self.src.model.tensors
                  if names is None or t.name in names}
        return {k: v for k, v in shifts.items() if v}

    @functools.cached_property
    def own_dtypes(self) -> dict[str, str]:
        """Canonical tensor name -> dtype, for the selected tensors kept in another dtype than the plan's (a float32
        router bias in a bfloat16 model): they travel bit-exact, counted in units of the plan's dtype."""
        names = set(self.selection) if self.selection is not None else None
        return {t.name: t.dtype for t in self.src.model.own_dtype_tensors if names is None or t.name in names}

    # --- the ops ---------------------------------------------------------------------------------
    @functools.cached_property
    def ops(self) -> dict[str, np.ndarray]:
        """Every op (OP_COLUMNS), sorted; expanded from the program on first use (read-only arrays)."""
        ops = expand(self.program)
        for a in ops.values():
            a.setflags(write=False)
        return ops

    def ops_sent_by(self, rank: int, side: int = SOURCE) -> dict[str, np.ndarray]:
        """The ops source rank `rank` sends (side SOURCE), or destination rank `rank` relays (RELAY), as in `ops`."""
        if side == SOURCE and not 0 <= rank < self.src.num_ranks:
            raise PlanError(f"source rank {rank} is outside [0, {self.src.num_ranks})")
        return expand(self.program, source_rank=rank) if side == SOURCE else expand(self.program, relay_rank=rank)

    def ops_received_by(self, rank: int) -> dict[str, np.ndarray]:
        """The ops that write destination rank `rank`, sorted as in `ops`."""
        return expand(self.program, receiver=rank)

    @property
    def num_ops(self) -> int:
        """How many ops the plan has, counted without expanding them."""
        return self.program.num_ops

    @property
    def itemsize(self) -> int:
        """Bytes of one plan unit: an element of the destination dtype (ops count in these units)."""
        return DTYPE_SIZES[self.dst.dtype]

    def op_bytes(self) -> np.ndarray:
        """Bytes of every op of `ops`, in its order."""
        return self.ops["rows"] * self.ops["cols"] * self.itemsize

    @property
    def transfers(self) -> list[Transfer]:
        """The ops grouped into messages, one per (stage, side, sender, receiver), in `ops` order."""
        keys = [self.ops[c] for c in ("stage", "src_side", "src_rank", "dst_rank")]
        if not len(keys[0]):
            return []
        cut = np.flatnonzero(np.any([k[1:] != k[:-1] for k in keys], axis=0)) + 1
        starts, stops = np.concatenate([[0], cut]), np.concatenate([cut, [len(keys[0])]])
        nbytes = np.add.reduceat(self.op_bytes(), starts)
        return [Transfer(*(int(k[a]) for k in keys), a, b, n)
                for a, b, n in zip(starts.tolist(), stops.tolist(), nbytes.tolist())]

    @property
    def num_stages(self) -> int:
        """Stages the ops run in: 1 without fan-out, tree depth + 1 with it, one more for EPLB slot copies (0 for a
        plan without ops)."""
        return self.accounting.num_stages

    @property
    def replica_parent(self) -> tuple[tuple[int, ...], ...]:
        """The fan-out trees: per part of the bytes, per destination replica, the replica it is relayed from
        (-1: fed by the source). One part unless relays are split (planner.fanout)."""
        return tuple(tuple(row) for row in self.program.parent.tolist())

    @property
    def tree_depth(self) -> int:
        """Relay levels of the deepest fan-out tree (0: the source feeds every replica)."""
        return int(self.program.stage.max(initial=0))

    # --- identity --------------------------------------------------------------------------------
    def _header(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "src": layout_to_dict(self.src),
            "dst": layout_to_dict(self.dst),
            "colocated": self.colocation is not None,  # rank for rank: no map, the header of older plans
            **({"colocation": list(self.colocation)} if self.colocation not in (None, tuple(range(self.dst.num_ranks)))
               else {}),
            "fanout": self.fanout,
            "roots": self.roots,
            "selection": list(self.selection) if self.selection is not None else None,
            "bounds": self.bounds.to_dict(),
            "program": self.program.scalars(),
        }

    def _compute_digest(self) -> str:
        h = hashlib.sha256(json.dumps(self._header(), sort_keys=True).encode())
        self.src_tensors.digest_update(h)
        self.dst_tensors.digest_update(h)
        for name, a in self.program.arrays().items():
            h.update(name.encode())
            h.update(np.ascontiguousarray(a, dtype="<i8").tobytes())
        return h.hexdigest()

    # --- persistence (never pickle) --------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        return {**self._header(), "src_tensors": self.src_tensors.to_dict(),
                "dst_tensors": self.dst_tensors.to_dict(), "coverage": self.coverage,
                "compile_seconds": self.compile_seconds, "digest": self.digest}

    def to_dict(self) -> dict[str, Any]:
        """The whole plan as JSON values (what a .json plan file holds; `from_dict` reads it back)."""
        return {**self._meta(), "arrays": {k: v.tolist() for k, v in self.program.arrays().items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        """A plan from its dict (`to_dict`), checked as untrusted input (planner.verify)."""
        from .verify import load_plan

        return load_plan(cls, d, None)

    def save(self, path: str | Path) -> Path:
        """Write `path` as .json (everything as JSON) or .npz (program arrays, header as JSON), by its suffix (any
        case); any other suffix is refused (ArgumentError)."""
        path = output_path("path", path, PLAN_SUFFIXES)
        if path.suffix.lower() == ".json":
            path.write_text(json.dumps(self.to_dict()))
            return path
        arrays = {f"a:{k}": v for k, v in self.program.arrays().items()}
        arrays["header"] = np.frombuffer(json.dumps(self._meta()).encode(), dtype=np.uint8)
        with open(path, "wb") as f:
            np.savez_compressed(f, **arrays)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        """A saved plan (.json or .npz), read as untrusted input: its content must prove what it claims and match
        its digest (planner.verify)."""
        from .verify import load_plan, read_saved

        return load_plan(cls, *read_saved(path))

    # --- as text -------------------------------------------------------------------------------
    def __str__(self) -> str:
        """A few readable lines: what moves, how balanced, against the bound and the common pattern."""
        a, b = self.accounting, human_bytes
        shifts = sorted(Counter(self.value_shifts.values()).items())
        lb = a.lower_bound_bytes or 1
        lines = [
            f"reshard plan {self.digest[:12]}",
            f"  model        {self.src.model}",
            f"  source       {self.src}",
            f"  destination  {self.dst}" + _colocation_text(self.colocation),
            f"  selection    {len(self.selection)} tensors" if self.selection is not None else
            "  selection    whole model",
            f"  coverage     {self.coverage} (every destination element holding model data written once)",
            f"  ops          {a.num_ops:,} in {a.num_transfers:,} transfers (source->destination pairs)",
            f"  total        {b(a.total_bytes)} ({a.total_bytes:,} B)"
            + (f"; {b(a.cross_bytes)} cross devices, {b(a.local_bytes)} local copies"
               if self.colocation is not None else ""),
            f"  lower bound  {b(a.lower_bound_bytes)} ({a.total_bytes / lb:.3f}x of bound)",
            f"  gather+bcast {b(a.gather_broadcast_bytes)} ({a.gather_broadcast_bytes / lb:.1f}x of bound)",
            f"  busiest      sender {b(a.max_egress)} (balance {a.egress_balance:.3f}x mean), "
            f"receiver {b(a.max_ingress)}",
            f"  senders      busiest {a.egress_optimality:.4f}x of the bound no choice of senders beats "
            f"({b(a.egress_lower_bound)}"
            + (f"; guaranteed within one unit, {b(a.egress_unit_max)})" if a.holder_sets_laminar
               else "; holder sets not laminar: no guarantee)"),
            *([f"  fan-out      {self.roots} root replica(s) fed by the source, {len(self.replica_parent)} "
               f"tree(s), depth {self.tree_depth}, {a.num_stages} stages; busiest relay {b(a.max_relay_egress)}"]
              if self.fanout else []),
            *([f"  slot copies  {b(a.slot_copy_bytes)} of redundant experts copied inside the engines "
               f"({b(a.slot_copy_local_bytes)} on their own rank): the source sends each engine each expert once"]
              if a.slot_copy_bytes else []),
            *([f"  value shift  {', '.join(f'{v:+g} on {n} tensor' + 's' * (n > 1) for v, n in shifts)} (added "
               "after the copy: the two sides store these values differently)"] if shifts else []),
            *([f"  own dtype    {_own_dtypes_text(self)}"] if self.own_dtypes else []),
            f"  compile      {self.compile_seconds:.3f} s",
            "  egress by source rank:",
            *_rank_table("src", a.egress_bytes),
            "  ingress by destination rank:",
            *_rank_table("dst", a.ingress_bytes),
        ]
        return "\n".join(lines)


def human_bytes(n: float) -> str:
    """`n` bytes in B, KiB, MiB, GiB or TiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def _rank_table(label: str, values: tuple[int, ...], width: int = 8) -> list[str]:
    """Bytes by rank in rows of `width` ranks; runs of equal rows are folded."""
    rows = [(start, " ".join(f"{human_bytes(v):>10}" for v in values[start:start + width]))
            for start in range(0, len(values), width)]
    lines = []
    for cells, run in itertools.groupby(rows, key=lambda row: row[1]):
        run = list(run)
        start = run[0][0]
        lines.append(f"    {label} {start:>4}-{min(start + width, len(values)) - 1:<4} {cells}")
        if len(run) > 1:
            lines.append(f"    {'':>9} ... {len(run) - 1} more rows of ranks like the one above")
    return lines


def _own_dtypes_text(plan: Plan) -> str:
    own = plan.own_dtypes
    n = len(own)
    return (f"{n} tensor{'s' * (n > 1)} kept in {'/'.join(sorted(set(own.values())))} travel bit-exact as "
            f"{plan.dst.dtype} units (e.g. {next(iter(own))})")


def _colocation_text(colocation: tuple[int, ...] | None) -> str:
    if colocation is None:
        return ""
    if colocation == tuple(range(len(colocation))):
        return "  (colocated with source ranks)"
    shown = ", ".join(f"{d}->{s}" for d, s in enumerate(colocation[:16])) + (", ..." if len(colocation) > 16 else "")
    return f"  (colocated: destination->source rank {shown})"
