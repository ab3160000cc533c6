"""The index checks every Plan runs on its program when it is built, whatever its origin: every index inside what
it indexes, the fan-out forests well formed, holder choices inside their boxes, op shapes positive. A program
that broke them would expand into other ops than its author meant (numpy wraps negative indices) or make the
accounting allocate by its values. Failures are PlanFileError naming the entry."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import PlanFileError, show
from ..limits import MAX_PARAMS
from .fanout import check_forest
from .program import Program

BIG = 1 << 62  # no offset, length or count of a valid plan comes near this


def bad(field: str, value: Any, rule: str, problems: list[str] | tuple[str, ...] = ()) -> PlanFileError:
    """The error for a plan file whose `field` holds `value` against `rule` (for the caller to raise)."""
    return PlanFileError(f"plan file: {field}={show(value)} {rule}", problems, field=field, value=value)


def within(field: str, a: np.ndarray, low: int, high: int) -> None:
    """Every value of `a` in [low, high)."""
    out = np.flatnonzero((a < low) | (a >= high))
    if len(out):
        i = int(out[0])
        raise bad(f"{field}[{i}]", int(a[i]), f"must be in [{low}, {high}) ({len(out)} entries are not)")


def same(field: str, a: np.ndarray, b: np.ndarray, what: str) -> None:
    """Raise `bad` at the first entry where `a` differs from `b`, the value it must have (`what` says why)."""
    diff = np.flatnonzero(a != b)
    if len(diff):
        i = int(diff[0])
        raise bad(f"{field}[{i}]", int(a[i]), f"must be {int(b[i])} ({what}; {len(diff)} entries differ)")


def _check_program(p: Program, src_tables: Any, dst_table: Any, S: int, K: int, num_canon: int) -> None:
    """Every index inside what it indexes, the forests well formed, the holder choices inside their boxes."""
    B, H, G = len(p.box_hstart), len(p.h_rank), len(p.group_box)
    T0, rpr = p.tensors_per_replica, p.ranks_per_replica
    if p.parent.shape != p.stage.shape or p.parent.shape[1:] != (K,) or p.parent.shape[0] < 1:
        raise bad("arrays.parent", p.parent.shape, f"must be (parts >= 1, {K} replicas) like arrays.stage")
    within("arrays.stage", p.stage.reshape(-1), 0, K + 1)  # a stage per tree level: at most one per replica
    problems = check_forest(p.parent, p.stage)
    if problems:
        raise bad("arrays.parent", "...", "does not describe fan-out forests", problems)
    fed = np.flatnonzero(p.parent[0] < 0)
    if len(p.fed) != len(fed):
        raise bad("arrays.fed", len(p.fed), f"must list the {len(fed)} replicas that arrays.parent says are fed")
    same("arrays.fed", p.fed, fed, "the replicas fed by the source, ascending")
    if p.choice.shape != (len(fed), G):
        raise bad("arrays.choice", p.choice.shape, f"must be ({len(fed)} fed replicas, {G} groups)")
    within("arrays.box_hcount", p.box_hcount, 1, BIG)
    same("arrays.box_hstart", p.box_hstart, np.cumsum(p.box_hcount) - p.box_hcount, "holders of box b follow "
          "those of box b - 1")
    if B and int(p.box_hstart[-1] + p.box_hcount[-1]) != H:
        raise bad("arrays.box_hcount", int(p.box_hcount.sum()), f"must sum to the {H} holders")
    within("arrays.h_rank", p.h_rank, 0, S)
    within("arrays.h_tensor", p.h_tensor, 0, len(src_tables))
    same("arrays.h_rank", p.h_rank, src_tables.rank[p.h_tensor], "the rank of the holder's source tensor")
    within("arrays.h_base", p.h_base, 0, MAX_PARAMS)
    within("arrays.h_stride", p.h_stride, 1, MAX_PARAMS)
    t, r, c = p.template, p.relay, p.copies  # c: EPLB slot copies, both ends inside replica 0's tensors
    within("arrays.t.box", t["box"], 0, B)
    for prefix, ops, ends in (("arrays.t.", t, ("dst",)), ("arrays.r.", r, ("dst",)), ("arrays.c.", c, ("src", "dst"))):
        within(prefix + "canon", ops["canon"], 0, num_canon)
        for end in ends:
            within(f"{prefix}{end}_rank", ops[f"{end}_rank"], 0, rpr)
            within(f"{prefix}{end}_tensor", ops[f"{end}_tensor"], 0, T0)
            same(f"{prefix}{end}_rank", ops[f"{end}_rank"], dst_table.rank[ops[f"{end}_tensor"]],
                 "the rank of its tensor")
        _op_shape(prefix, ops)
    within("arrays.t.src_d0", t["src_d0"], 0, MAX_PARAMS)
    within("arrays.t.src_d1", t["src_d1"], 0, MAX_PARAMS)
    g = t["group"]
    if len(g):
        if int(g[0]) != 0 or not np.isin(np.diff(g), (0, 1)).all() or int(g[-1]) != G - 1:
            raise bad("arrays.t.group", "...", f"must number the {G} groups in order, 0, 0, 1, ... (sorted, no gaps)")
        first = np.flatnonzero(np.diff(np.concatenate([[-1], g])))
        same("arrays.group_box", p.group_box, t["box"][first], "the box of the group's first op")
    elif G:
        raise bad("arrays.group_box", G, "must be empty when the template has no ops")
    fewest = np.full(G, BIG, dtype=np.int64)
    np.minimum.at(fewest, g, p.box_hcount[t["box"]])
    out = np.argwhere((p.choice < 0) | (p.choice >= fewest[None, :]))
    if len(out):
        f, k = (int(x) for x in out[0])
        raise bad(f"arrays.choice[{f}][{k}]", int(p.choice[f, k]), f"must be in [0, {int(fewest[k])}) (a holder "
                  f"of every box of group {k})")
    within("arrays.r.part", r["part"], 0, p.num_parts)
    if len(fed) == K and len(r["rows"]):
        raise bad("arrays.r.rows", len(r["rows"]), "must be empty: every replica is fed by the source")
    within("arrays.c.src_offset", c["src_offset"], 0, MAX_PARAMS)
    within("arrays.c.src_stride", c["src_stride"], 1, MAX_PARAMS)


def check_program(plan: Any) -> None:
    """The index checks of the module docstring on `plan`'s program, against its layouts and tables."""
    if len(plan.dst_tensors) != plan.program.tensors_per_replica * plan.dst.num_replicas or \
            plan.program.ranks_per_replica != plan.dst.ranks_per_replica:
        raise bad("program", plan.program.scalars(), f"does not fit the destination ({plan.dst})")
    _check_program(plan.program, plan.src_tensors, plan.dst_tensors, plan.src.num_ranks, plan.dst.num_replicas,
                   len(plan.src.model.canonical))


def _op_shape(prefix: str, ops: dict[str, np.ndarray]) -> None:
    """rows, cols and the destination stride positive; a block of several rows no wider than its stride."""
    within(prefix + "rows", ops["rows"], 1, MAX_PARAMS)
    within(prefix + "cols", ops["cols"], 1, MAX_PARAMS)
    within(prefix + "dst_stride", ops["dst_stride"], 1, MAX_PARAMS)
    within(prefix + "dst_offset", ops["dst_offset"], 0, MAX_PARAMS)
    narrow = np.flatnonzero((ops["rows"] > 1) & (ops["dst_stride"] < ops["cols"]))
    if len(narrow):
        i = int(narrow[0])
        raise bad(f"{prefix}dst_stride[{i}]", int(ops["dst_stride"][i]), f"is narrower than the block's "
                  f"{int(ops['cols'][i])} columns (rows would overlap)")


