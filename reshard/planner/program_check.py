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
from .program import COPY_COLUMNS

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


def check_program(plan: Any) -> None:
    """The index checks of the module docstring on `plan`'s program, against its layouts and tables."""
    p, src_tables, dst_table, K = plan.program, plan.src_tensors, plan.dst_tensors, plan.dst.num_replicas
    if len(dst_table) != p.tensors_per_replica * K or p.ranks_per_replica != plan.dst.ranks_per_replica:
        raise bad("program", p.scalars(), f"does not fit the destination ({plan.dst})")
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
    # every index inside what it indexes, every offset, stride and length inside a tensor (op shapes positive);
    # c: EPLB slot copies, both ends inside replica 0's tensors
    a = {**{f"c.{c}": p.copies[c] for c in COPY_COLUMNS}, **p.arrays()}
    ends = {"t.": ("dst",), "r.": ("dst",), "c.": ("src", "dst")}
    ranges = [("box_hcount", 1, BIG), ("h_rank", 0, plan.src.num_ranks), ("h_tensor", 0, len(src_tables)),
              ("h_base", 0, MAX_PARAMS), ("h_stride", 1, MAX_PARAMS), ("t.box", 0, B), ("t.src_d0", 0, MAX_PARAMS),
              ("t.src_d1", 0, MAX_PARAMS), ("r.part", 0, p.num_parts), ("c.src_offset", 0, MAX_PARAMS),
              ("c.src_stride", 1, MAX_PARAMS)]
    for prefix, sides in ends.items():
        ranges += [(prefix + "canon", 0, len(plan.src.model.canonical)), (prefix + "rows", 1, MAX_PARAMS),
                   (prefix + "cols", 1, MAX_PARAMS), (prefix + "dst_stride", 1, MAX_PARAMS),
                   (prefix + "dst_offset", 0, MAX_PARAMS)]
        ranges += [(f"{prefix}{end}_{c}", 0, high) for end in sides for c, high in (("rank", rpr), ("tensor", T0))]
    for name, low, high in ranges:
        within(f"arrays.{name}", a[name], low, high)
    same("arrays.box_hstart", p.box_hstart, np.cumsum(p.box_hcount) - p.box_hcount, "holders of box b follow "
         "those of box b - 1")
    if B and int(p.box_hstart[-1] + p.box_hcount[-1]) != H:
        raise bad("arrays.box_hcount", int(p.box_hcount.sum()), f"must sum to the {H} holders")
    same("arrays.h_rank", p.h_rank, src_tables.rank[p.h_tensor], "the rank of the holder's source tensor")
    for prefix, sides in ends.items():
        for end in sides:
            same(f"arrays.{prefix}{end}_rank", a[f"{prefix}{end}_rank"], dst_table.rank[a[f"{prefix}{end}_tensor"]],
                 "the rank of its tensor")
        narrow = np.flatnonzero((a[prefix + "rows"] > 1) & (a[prefix + "dst_stride"] < a[prefix + "cols"]))
        if len(narrow):
            i = int(narrow[0])
            raise bad(f"arrays.{prefix}dst_stride[{i}]", int(a[prefix + "dst_stride"][i]), f"is narrower than the "
                      f"block's {int(a[prefix + 'cols'][i])} columns (rows would overlap)")
    t, g = p.template, p.template["group"]
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
    if len(fed) == K and len(p.relay["rows"]):
        raise bad("arrays.r.rows", len(p.relay["rows"]), "must be empty: every replica is fed by the source")
