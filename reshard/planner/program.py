"""The ops of a plan, factored by destination replica: what a plan stores, and how op rows are expanded from it.

Replicas share one layout, so one replica's ops (the *template*, in replica 0's coordinates) say what every
replica receives; only the senders differ. A replica *fed* by the source takes each template op from one holder
of its source box (`choice[f, group]`, per group of ops so that adjacent ops stay together); a *relayed* one gets
the template's regions (the *relay template*, cut into parts) from replica `parent[j, k]` in stage `stage[j, k]`
(planner.fanout); every replica then fills its redundant EPLB expert slots from its own first slot (the *copies*,
in `copy_stage`, after every other). A rank's executor expands only its own rows (`expand(..., receiver=...)`).

Every Plan runs `check_program` on its program when it is built, whatever its origin: every index inside what it
indexes, the fan-out forests well formed, holder choices inside their boxes, op shapes positive. A program that
broke them would expand into other ops than its author meant (numpy wraps negative indices) or make the
accounting allocate by its values. Failures are PlanFileError naming the entry.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import PlanError, PlanFileError, show
from ..limits import MAX_PARAMS
from .fanout import check_forest
from .merge import sort_ops
from .tables import frozen_ints

TEMPLATE_COLUMNS = ("canon", "box", "src_d0", "src_d1", "dst_rank", "dst_tensor", "dst_offset", "dst_stride",
                    "rows", "cols", "group")
RELAY_COLUMNS = ("canon", "dst_rank", "dst_tensor", "dst_offset", "dst_stride", "rows", "cols", "part")
COPY_COLUMNS = ("canon", "src_rank", "src_tensor", "src_offset", "src_stride", "dst_rank", "dst_tensor", "dst_offset",
                "dst_stride", "rows", "cols")  # replica 0's coordinates; the source is a destination tensor
OP_COLUMNS = ("stage", "src_side", "src_rank", "src_tensor", "src_offset", "src_stride", "dst_rank", "dst_tensor",
              "dst_offset", "dst_stride", "rows", "cols", "canon")
SOURCE, RELAY = 0, 1  # values of src_side
OP_TABLES = {"template": ("t.", TEMPLATE_COLUMNS), "relay": ("r.", RELAY_COLUMNS), "copies": ("c.", COPY_COLUMNS)}


@dataclass(frozen=True, eq=False)
class Program:
    """Template ops, relay template, slot copies, source holders, and per-replica feeding (see the module doc).

    Source offsets: a template op reads its box's holder h at h_base[h] + src_d0 * h_stride[h] + src_d1, with row
    stride h_stride[h] (or `cols` when rows == 1). Holder h of box b is box_hstart[b] + position.

    Attributes:
        template: TEMPLATE_COLUMNS, one row per op of replica 0.
        relay: RELAY_COLUMNS (empty when no replica is relayed).
        box_hstart: per source box, its first holder.
        box_hcount: per source box, how many holders it has.
        h_rank: per holder, the source rank.
        h_tensor: per holder, the source tensor id.
        h_base: per holder, the flat offset of the box's origin in that tensor.
        h_stride: per holder, the row stride.
        group_box: per group, one of its boxes (all of a group's boxes share the holder ranks).
        fed: the replicas the source feeds, in feeding order f = 0..R-1.
        choice: (R, G) holder position per fed replica and group.
        parent: (parts, replicas) the replica each part is relayed from, -1 if fed by the source.
        stage: (parts, replicas) the stage in which each replica receives each part.
        ranks_per_replica: destination ranks of one replica.
        tensors_per_replica: destination tensors of one replica.
        copies: COPY_COLUMNS, one row per redundant expert slot region of replica 0 (empty without).
    """

    template: dict[str, np.ndarray]
    relay: dict[str, np.ndarray]
    box_hstart: np.ndarray
    box_hcount: np.ndarray
    h_rank: np.ndarray
    h_tensor: np.ndarray
    h_base: np.ndarray
    h_stride: np.ndarray
    group_box: np.ndarray
    fed: np.ndarray
    choice: np.ndarray
    parent: np.ndarray
    stage: np.ndarray
    ranks_per_replica: int
    tensors_per_replica: int
    copies: dict[str, np.ndarray] = field(default_factory=dict)

    ARRAYS = ("box_hstart", "box_hcount", "h_rank", "h_tensor", "h_base", "h_stride", "group_box", "fed", "choice",
              "parent", "stage")

    def __post_init__(self) -> None:
        for name in self.ARRAYS:
            object.__setattr__(self, name, frozen_ints(getattr(self, name)))
        for attr, (_, cols) in OP_TABLES.items():
            object.__setattr__(self, attr, {c: frozen_ints(getattr(self, attr).get(c, ())) for c in cols})

    # --- sizes -----------------------------------------------------------------------------------
    @property
    def num_replicas(self) -> int:
        """Destination replicas."""
        return self.parent.shape[1]

    @property
    def num_parts(self) -> int:
        """Parts the relayed bytes are cut into (1 unless relays are split)."""
        return self.parent.shape[0]

    @property
    def num_template_ops(self) -> int:
        """Ops of one fed replica."""
        return len(self.template["rows"])

    @property
    def num_copy_ops(self) -> int:
        """Slot copies of one replica."""
        return len(self.copies["rows"])

    @property
    def copy_stage(self) -> int:
        """The stage of the slot copies: after every stage that feeds or relays."""
        return int(self.stage.max()) + 1

    @property
    def num_ops(self) -> int:
        """Ops of the whole plan once expanded."""
        return (len(self.fed) * self.num_template_ops + (self.num_replicas - len(self.fed)) * len(self.relay["rows"])
                + self.num_replicas * self.num_copy_ops)

    # --- persistence -------------------------------------------------------------------------------
    def arrays(self) -> dict[str, np.ndarray]:
        """Every array by its saved name (`t.` template, `r.` relay and `c.` slot copy columns; planner.verify reads
        them back)."""
        # slot copies only where there are some: the saved form and digest of every other plan stay as they were
        return {**{prefix + c: getattr(self, attr)[c] for attr, (prefix, cols) in OP_TABLES.items()
                   if attr != "copies" or self.num_copy_ops for c in cols},
                **{name: getattr(self, name) for name in self.ARRAYS}}

    def scalars(self) -> dict[str, int]:
        """The sizes a saved plan keeps in its JSON header."""
        return {"ranks_per_replica": self.ranks_per_replica, "tensors_per_replica": self.tensors_per_replica}


# --- the index checks every Plan runs ---------------------------------------------------------------------

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


# --- expansion to op rows -------------------------------------------------------------------------------

def _head(n: int, stage: int, side: int, cols: dict[str, np.ndarray], sel: np.ndarray) -> dict[str, np.ndarray]:
    """The columns every kind of op row fills alike: stage, side, and the block's rows, cols and canon."""
    return {"stage": np.full(n, stage, dtype=np.int64), "src_side": np.full(n, side, dtype=np.int64),
            **{c: cols[c][sel] for c in ("rows", "cols", "canon")}}


def _end(p: Program, cols: dict[str, np.ndarray], sel: np.ndarray, end: str, replica: int,
         side: str) -> dict[str, np.ndarray]:
    """One side's rank, tensor, offset and stride from replica-0 columns `end`, moved to destination `replica`."""
    return {f"{side}_rank": cols[f"{end}_rank"][sel] + replica * p.ranks_per_replica,
            f"{side}_tensor": cols[f"{end}_tensor"][sel] + replica * p.tensors_per_replica,
            f"{side}_offset": cols[f"{end}_offset"][sel], f"{side}_stride": cols[f"{end}_stride"][sel]}


def _feed_rows(p: Program, f: int, mask: np.ndarray | None, holder_rank: int | None) -> dict[str, np.ndarray]:
    t = p.template
    k = int(p.fed[f])
    sel = np.arange(p.num_template_ops) if mask is None else np.flatnonzero(mask)
    h = p.box_hstart[t["box"][sel]] + p.choice[f][t["group"][sel]]
    if holder_rank is not None:
        keep = p.h_rank[h] == holder_rank
        sel, h = sel[keep], h[keep]
    return {**_head(len(sel), p.stage[0, k], SOURCE, t, sel), **_end(p, t, sel, "dst", k, "dst"),
            "src_rank": p.h_rank[h], "src_tensor": p.h_tensor[h],
            "src_offset": p.h_base[h] + t["src_d0"][sel] * p.h_stride[h] + t["src_d1"][sel],
            "src_stride": np.where(t["rows"][sel] == 1, t["cols"][sel], p.h_stride[h])}


def _relay_rows(p: Program, k: int, mask: np.ndarray | None, part: int) -> dict[str, np.ndarray]:
    r = p.relay
    sel = np.flatnonzero(r["part"] == part if mask is None else mask & (r["part"] == part))
    return {**_head(len(sel), p.stage[part, k], RELAY, r, sel), **_end(p, r, sel, "dst", int(p.parent[part, k]), "src"),
            **_end(p, r, sel, "dst", k, "dst")}


def _copy_rows(p: Program, k: int, mask: np.ndarray | None) -> dict[str, np.ndarray]:
    c = p.copies
    sel = np.arange(p.num_copy_ops) if mask is None else np.flatnonzero(mask)
    return {**_head(len(sel), p.copy_stage, RELAY, c, sel), **_end(p, c, sel, "src", k, "src"),
            **_end(p, c, sel, "dst", k, "dst")}


def expand(p: Program, *, source_rank: int | None = None, relay_rank: int | None = None,
           receiver: int | None = None) -> dict[str, np.ndarray]:
    """Op rows (OP_COLUMNS), sorted by SORT_KEYS: all of them, or only those that source rank `source_rank`
    sends, that destination rank `relay_rank` forwards, or that destination rank `receiver` receives."""
    blocks = []
    fed_index = np.full(p.num_replicas, -1, dtype=np.int64)  # per replica: its position f in `fed`, -1 if relayed
    fed_index[p.fed] = np.arange(len(p.fed))
    rpr = p.ranks_per_replica
    for rank in (receiver, relay_rank):
        if rank is not None and not 0 <= rank < rpr * p.num_replicas:
            raise PlanError(f"destination rank {rank} is outside [0, {rpr * p.num_replicas})")
    parts = range(p.num_parts)
    if relay_rank is not None:
        k, r = divmod(relay_rank, rpr)
        blocks += [_relay_rows(p, child, p.relay["dst_rank"] == r, j) for j in parts
                   for child in np.flatnonzero(p.parent[j] == k).tolist()]
        blocks.append(_copy_rows(p, k, p.copies["src_rank"] == r))
    elif source_rank is not None:
        held = np.zeros(len(p.box_hstart), dtype=bool)  # boxes this rank holds: only their ops can be its
        held[np.repeat(np.arange(len(p.box_hstart)), p.box_hcount)[p.h_rank == source_rank]] = True
        mask = held[p.template["box"]]
        blocks += [_feed_rows(p, f, mask, source_rank) for f in range(len(p.fed))]
    else:  # every replica's rows, or those into `receiver`
        replica, r = divmod(receiver, rpr) if receiver is not None else (None, None)
        into = {n: None if r is None else getattr(p, n)["dst_rank"] == r for n in ("template", "relay", "copies")}
        for k in range(p.num_replicas) if replica is None else (replica,):
            blocks += ([_feed_rows(p, int(fed_index[k]), into["template"], None)] if fed_index[k] >= 0
                       else [_relay_rows(p, k, into["relay"], j) for j in parts])
            blocks.append(_copy_rows(p, k, into["copies"]))
    if not blocks:
        return {c: np.zeros(0, np.int64) for c in OP_COLUMNS}
    return sort_ops({c: np.concatenate([b[c] for b in blocks]) for c in OP_COLUMNS})
