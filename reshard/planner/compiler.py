"""compile(src, dst) -> Plan, vectorized end to end (no Python loop per tensor, placement or op):
  1. select the canonical tensors and read both layouts' placements as tables (`Layout.placement_table`), the
     source for all ranks, the destination for replica 0;
  2. group source placements into distinct boxes, each with its holders (the ranks that hold it);
  3. intersect every destination box with its canonical tensor's source boxes (binary search, never all pairs):
     the template, one replica's ops; merge ops adjacent on both sides whichever holder sends (planner.merge);
  4. build the fan-out forest over replicas (planner.fanout), choose a holder per fed replica and group of ops
     (planner.balance);
  5. prove that the template and the relay template write every destination model element exactly once
     (planner.coverage; replicas are identical, so this proves the whole plan), and an expert-parallel
     destination's slots (`prove_expert_slots`); seal the factored ops (planner.program) and account them.
"""
from __future__ import annotations

import time
from typing import Iterable, Sequence

import numpy as np

from ..arguments import instance, integer, integers, names
from ..arrays import sort_by, unique_inverse
from ..errors import PlanError
from ..layouts import Layout, ModelSpec
from ..layouts.base import PlacementTable
from .accounting import Bounds
from .balance import choose_holders
from .coverage import band_segments, overlapping, prove_expert_slots, prove_program, sorted_unique
from .fanout import replica_forests, slot_copies, split_parts
from .merge import distinct, merge_relay, merge_template, run_positions
from .plan import Plan, TensorTable
from .program import TEMPLATE_COLUMNS, Program
from .selection import bound_facts, data_rows, select_indices, unit_placements, unit_ratios


def _tensor_ids(t: PlacementTable, mask: np.ndarray, side: str,
                dtypes: tuple[str, ...] = ()) -> tuple[np.ndarray, TensorTable]:
    """Physical tensor id per row (-1 outside `mask`), ids sorted by (rank, kind); one shape per (rank, name)."""
    nk = max(len(t.kinds), 1)
    uniq, inverse = distinct(t.rank[mask] * nk + t.kind[mask])
    tid = np.full(len(t), -1, dtype=np.int64)
    tid[mask] = inverse
    table = TensorTable(uniq // nk, uniq % nk, t.kinds, dtypes)
    if len({name for name, _ in t.kinds}) < len(t.kinds):  # a name of two shapes: one (rank, name) twice?
        first = table.find(table.rank, table.names)
        twice = np.flatnonzero(first != np.arange(len(table)))
        if len(twice):
            raise PlanError(f"{side} layout gives a tensor two shapes",
                            [f"rank {table.rank[i]} tensor {table.name(i)!r}: {table.shape(first[i])} and "
                             f"{table.shape(i)}" for i in twice.tolist()])
    return tid, table


class _Boxes:
    """Distinct source boxes (canonical tensor + 2-D box), sorted by (canon, c0, c1), each with its holders."""

    def __init__(self, S: PlacementTable, tid: np.ndarray, data: np.ndarray):
        rows = np.flatnonzero(data)
        order = rows[sort_by((S.canon[rows], S.c0[rows], S.c1[rows], S.n0[rows], S.n1[rows], S.rank[rows]))]
        key = [S.canon[order], S.c0[order], S.c1[order], S.n0[order], S.n1[order]]
        n = len(order)
        new_box, dup = np.ones(n, dtype=bool), np.zeros(n, dtype=bool)  # dup: a rank holding the same box twice
        if n > 1:  # (its first placement is kept)
            new_box[1:] = np.any([k[1:] != k[:-1] for k in key], axis=0)
            dup[1:] = ~new_box[1:] & (S.rank[order][1:] == S.rank[order][:-1])
        order, new_box = order[~dup], new_box[~dup]
        first = np.flatnonzero(new_box)
        self.canon, self.c0, self.c1, self.n0, self.n1 = (x[order[first]] for x in (S.canon, S.c0, S.c1, S.n0, S.n1))
        self.hstart = first
        self.hcount = np.diff(np.append(first, len(order)))
        self.h_rank, self.h_tensor = S.rank[order], tid[order]
        self.h_base, self.h_stride = S.origin[order], S.stride[order]
        lo = np.minimum.reduceat(self.h_stride, first) if len(first) else first
        hi = np.maximum.reduceat(self.h_stride, first) if len(first) else first
        self.stride = np.where(lo == hi, lo, -1)
        self._holder_sets()

    def __len__(self) -> int:
        return len(self.canon)

    def _holder_sets(self) -> None:
        """Number the distinct holder rank lists, by size then ranks (CSR: hset_start, hset_count, hset_ranks)."""
        mat = np.full((len(self), int(self.hcount.max(initial=0))), -1, dtype=np.int64)  # each box's holder ranks
        mat[np.repeat(np.arange(len(self)), self.hcount), run_positions(self.hcount)] = self.h_rank
        first, self.hset = unique_inverse((self.hcount, *mat.T))
        self.hset_count = self.hcount[first]
        self.hset_start = np.cumsum(self.hset_count) - self.hset_count
        self.hset_ranks = mat[first][mat[first] >= 0]

    def overlaps(self, model: ModelSpec, width: np.ndarray) -> list[str]:
        """Distinct boxes of one canonical tensor must lie inside it and not overlap (else the source layout is
        inconsistent). `width`: each canonical tensor's columns, in units."""
        c = model.canonical
        outside = np.flatnonzero((self.c0 < 0) | (self.c1 < 0) | (self.c0 + self.n0 > c.rows[self.canon])
                                 | (self.c1 + self.n1 > width[self.canon]))
        if len(outside):
            return [f"source layout places a box outside {model.tensor_name(int(self.canon[i]))}: rows "
                    f"[{self.c0[i]}, {self.c0[i] + self.n0[i]}), cols [{self.c1[i]}, {self.c1[i] + self.n1[i]})"
                    for i in outside[:10]]
        if len(self) < 2:
            return []
        base = int(width.max()) + 1
        edges = sorted_unique(np.concatenate([self.canon * base + self.c1, self.canon * base + self.c1 + self.n1]))
        band, start, end = band_segments(self.canon, self.c0, self.c1, self.n0, self.n1, base, edges)
        out = []
        for i in overlapping(band, start, end)[:10]:
            c = int(edges[band[i]] // base)
            out.append(f"source layout holds overlapping but different boxes of {model.tensor_name(c)} "
                       f"(rows [{start[i + 1]}, {min(end[i], end[i + 1])}))")
        return out


def _intersect(boxes: _Boxes, D: PlacementTable, tid: np.ndarray, num_canon: int) -> dict[str, np.ndarray]:
    """Template ops: every (destination row, source box) of one canonical tensor that meet, with offsets.

    A query's candidates are its canonical tensor's boxes; where a tensor has many boxes, a binary search on the
    boxes' row starts (and the running maximum of their row ends) narrows them to those that can meet the query.
    """
    if not len(D) or not len(boxes):
        return {k: np.zeros(0, np.int64) for k in TEMPLATE_COLUMNS[:-1]}  # no "group" yet
    qc, a0, a1, m0, m1 = D.canon, D.c0, D.c1, D.n0, D.n1
    first = np.searchsorted(boxes.canon, np.arange(num_canon + 1))
    lo, hi = first[qc], first[qc + 1]
    many = np.flatnonzero(hi - lo > 8)
    if len(many):
        base = int(max((boxes.c0 + boxes.n0).max(), (a0 + m0).max())) + 1
        start_key = boxes.canon * base + boxes.c0  # ascending: boxes are sorted by (canon, c0)
        reach = np.maximum.accumulate(boxes.canon * base + boxes.c0 + boxes.n0)  # running max of row ends
        c = qc[many]
        hi[many] = np.searchsorted(start_key, c * base + a0[many] + m0[many], side="left")
        lo[many] = np.searchsorted(reach, c * base + a0[many], side="right")
    count = np.maximum(hi - lo, 0)
    # Queries with one candidate box (most of them: an expert has one box) need no expansion; the others are
    # expanded and filtered apart, so the common case copies nothing it does not keep.
    one = np.flatnonzero(count == 1)
    rest = np.flatnonzero(count > 1)
    qn = np.repeat(rest, count[rest])
    bn = np.repeat(lo[rest], count[rest]) + run_positions(count[rest])
    parts = [_meet(boxes, D, tid, q, b) for q, b in ((one, lo[one]), (qn, bn)) if len(q)]
    if len(parts) == 1:
        return parts[0]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _meet(boxes: _Boxes, D: PlacementTable, tid: np.ndarray, q: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    """The ops of destination rows q meeting boxes b (pairs that do not meet are dropped)."""
    bc0, bc1 = boxes.c0[b], boxes.c1[b]
    qa0, qa1 = D.c0[q], D.c1[q]
    i0, i1 = np.maximum(qa0, bc0), np.maximum(qa1, bc1)
    e0 = np.minimum(qa0 + D.n0[q], bc0 + boxes.n0[b])
    e1 = np.minimum(qa1 + D.n1[q], bc1 + boxes.n1[b])
    hit = (e0 > i0) & (e1 > i1)
    if not hit.all():
        hit = np.flatnonzero(hit)
        q, b, i0, i1, e0, e1, bc0, bc1, qa0, qa1 = (x[hit] for x in (q, b, i0, i1, e0, e1, bc0, bc1, qa0, qa1))
    stride = D.stride[q]
    return {"canon": D.canon[q], "box": b, "src_d0": i0 - bc0, "src_d1": i1 - bc1, "dst_rank": D.rank[q],
            "dst_tensor": tid[q], "dst_offset": D.origin[q] + (i0 - qa0) * stride + (i1 - qa1), "dst_stride": stride,
            "rows": e0 - i0, "cols": e1 - i1}


def _check_source_boxes(boxes: _Boxes, src: TensorTable) -> None:
    """Every holder's box lies inside its source tensor (rows no wider than the tensor's rows). Template ops read
    sub-boxes of their boxes, and merged ops contiguous unions of such reads, so this bounds every read."""
    b = np.repeat(np.arange(len(boxes)), boxes.hcount)
    last = boxes.h_base + (boxes.n0[b] - 1) * boxes.h_stride + boxes.n1[b]
    bad = np.flatnonzero((boxes.h_base < 0) | (boxes.n1[b] > boxes.h_stride) | (last > src.numel()[boxes.h_tensor]))
    if len(bad):
        raise PlanError("source placements lie outside their source tensors",
                        [f"source rank {src.rank[boxes.h_tensor[i]]} {src.name(boxes.h_tensor[i])!r}"
                         for i in bad[:10]])


def colocation_ranks(colocated: "bool | Sequence[int]", num_src: int, num_dst: int) -> np.ndarray | None:
    """Per destination rank, the source rank on its device; None when nothing is colocated."""
    if colocated is True:
        if num_dst > num_src:
            raise PlanError(f"colocated placement needs a source rank per destination rank: "
                            f"{num_dst} destination ranks, {num_src} source ranks (or give the source rank of "
                            f"each destination rank)")
        return np.arange(num_dst, dtype=np.int64)
    if colocated is False:
        return None
    ranks = list(colocated)  # integers (checked by the caller)
    problems = ([f"{len(ranks)} entries for {num_dst} destination ranks"] if len(ranks) != num_dst else [])
    problems += [f"destination rank {d} -> source rank {r}, outside [0, {num_src})"
                 for d, r in enumerate(ranks) if not 0 <= r < num_src]
    if problems:
        raise PlanError("colocated: the source rank on each destination rank's device is malformed", problems)
    return np.asarray(ranks, dtype=np.int64)


def check_same_model(src: Layout, dst: Layout) -> None:
    """Refuse layouts of two different models (PlanError showing both)."""
    if src.model != dst.model:
        raise PlanError("source and destination describe different models",
                        [f"source: {src.model}", f"destination: {dst.model}"])


def _tables(src: Layout, dst: Layout, sel: np.ndarray) -> tuple[TensorTable, _Boxes, TensorTable, np.ndarray,
                                                                   PlacementTable]:
    """Placements as tables in units of the model's dtype (a float32 router bias counts two bfloat16 units): the
    source's tensors and distinct boxes (checked consistent and inside their tensors) for all its ranks; the
    destination's tensors for replica 0, and its placements with data with their tensor ids."""
    model = src.model
    shifted = [t.name for t in model.own_dtype_tensors if dst.value_offset(t) != src.value_offset(t)]
    if shifted:  # a shift adds to values, which units of another dtype are not
        raise PlanError(f"{shifted[0]} is kept in its own dtype and the layouts store it with different offsets")
    S, s_dtypes, D, d_dtypes = unit_placements(src, dst, sel)
    s_data = S.n0 * S.n1 > 0
    s_tid, src_table = _tensor_ids(S, s_data, "source", s_dtypes)
    d_tid, dst_table0 = _tensor_ids(D, np.ones(len(D), dtype=bool), "destination", d_dtypes)
    outside = np.flatnonzero(D.rank >= dst.ranks_per_replica)
    if len(outside):
        raise PlanError(f"destination layout places replica 0 of {model.tensor_name(int(D.canon[outside[0]]))} "
                        f"outside ranks [0, {dst.ranks_per_replica})")
    boxes = _Boxes(S, s_tid, s_data)
    num, den, _ = unit_ratios(model)
    problems = boxes.overlaps(model, model.canonical.cols * num // den)
    if problems:
        raise PlanError("source layout is inconsistent", problems)
    _check_source_boxes(boxes, src_table)
    return src_table, boxes, dst_table0, d_tid[D.n0 * D.n1 > 0], data_rows(D)


def compile_plan(src: Layout, dst: Layout, *, tensors: Iterable[str] | None = None,
                 layers: Iterable[int] | None = None, colocated: bool | Sequence[int] = False,
                 fanout: int | None = None, roots: int | None = None, relay_cap: int = 1,
                 expert_copies: bool = True) -> Plan:
    """Compile the refit from `src` to `dst` into a plan proven to write every destination element once.

    Args:
        src: the source layout (e.g. a `MegatronLayout`).
        dst: the destination layout (e.g. a `VllmLayout`); same model and dtype as `src`.
        tensors: compile only these canonical tensors (a subset plan).
        layers: compile only these layers' tensors (a subset plan).
        colocated: True: destination rank d shares a device with source rank d, its bytes from there are local
            copies (preferred when several sources hold them). A sequence instead gives, per destination rank,
            the source rank on its device (e.g. [1, 0] when the engine numbers the two GPUs the other way).
        fanout: feed only `roots` destination replicas from the source and relay to the others along trees in
            which each replica has at most `fanout` children (None: the source feeds every replica).
        roots: replicas the source feeds when fanout is set; default: the fewest holders any source byte has
            (each trainer data-parallel copy feeds one root, so no trainer rank sends much more than it holds).
        relay_cap: no destination rank relays more than relay_cap times what it receives (the bytes are split
            over ceil(fanout / relay_cap) trees whose interiors are disjoint).
        expert_copies: with `fanout` (a transport that relays), an EPLB destination's redundant expert slots are
            copied inside each replica from the slot the source feeds (planner.fanout.slot_copies), so the source
            sends each replica one copy of every expert. False, or no fanout: the source feeds every slot.

    Returns:
        The plan, with its byte accounting and digest.

    Raises:
        PlanError: the layouts describe different models or dtypes, or fanout options that contradict.
        ArgumentError: a selection or colocation that names no tensor, layer or rank of the layouts.
        CoverageError: the plan would not write every destination element holding model data exactly once.
    """
    instance("src", src, Layout, "a Layout")  # the arguments by type, each refused with ArgumentError naming it
    instance("dst", dst, Layout, "a Layout")
    names("tensors", tensors)
    integers("layers", layers)
    if not isinstance(colocated, bool):
        integers("colocated", colocated, none=False)
    if fanout is not None:
        integer("fanout", fanout, 1, 1 << 20)
    if roots is not None:
        integer("roots", roots, 1, 1 << 20)
    integer("relay_cap", relay_cap, 1, 1 << 20)
    if not isinstance(expert_copies, bool):
        raise PlanError(f"expert_copies={expert_copies!r} must be True or False")
    start = time.perf_counter()
    check_same_model(src, dst)
    if src.dtype != dst.dtype:
        raise PlanError(f"source dtype {src.dtype} differs from destination dtype {dst.dtype}")
    colocation = colocation_ranks(colocated, src.num_ranks, dst.num_ranks)
    if roots is not None and not fanout:
        raise PlanError(f"roots={roots} needs fanout (without it the source feeds every replica)")
    model = src.model
    sel = select_indices(model, tensors, layers)
    subset = tensors is not None or layers is not None
    K, rpr = dst.num_replicas, dst.ranks_per_replica
    src_table, boxes, dst_table0, d_tid, D = _tables(src, dst, sel)

    # One replica's ops, merged whichever holder sends them.
    ops = _intersect(boxes, D, d_tid, len(model.canonical))
    stacks = dst.expert_stacks()
    if stacks is not None:  # expert-parallel slots (EPLB's replicas among them): proven before merging, while
        # each op still names its canonical box
        prove_expert_slots(stacks, dst_table0, d_tid, D, not subset, {
            **ops, "canon_r0": boxes.c0[ops["box"]] + ops["src_d0"], "canon_c0": boxes.c1[ops["box"]] + ops["src_d1"]},
            model.canonical)
    ops, copies = slot_copies(ops, model.canonical.expert) if stacks is not None and expert_copies and fanout \
        else (ops, {})
    template = merge_template(ops, boxes.hset, boxes.stride, boxes.hstart, boxes.hcount, boxes.h_tensor,
                              boxes.h_base, boxes.h_stride)
    first_of_group = np.flatnonzero(np.diff(np.append(-1, template["group"])))
    group_box = template["box"][first_of_group]
    group_bytes = np.bincount(template["group"], weights=template["rows"] * template["cols"],
                              minlength=len(group_box)).astype(np.int64) * model.itemsize

    # Who feeds whom: the forest over replicas, then a holder per fed replica and group.
    if fanout and roots is None:
        roots = int(min(K, boxes.hcount[template["box"]].min(initial=K)))
    parent, stage = replica_forests(K, fanout, roots or K, relay_cap)
    fed = np.flatnonzero(parent[0] < 0)
    choice, balance = choose_holders(group_bytes, boxes.hset[group_box], template["dst_rank"][first_of_group],
                                     boxes.hset_start, boxes.hset_count, boxes.hset_ranks, fed, rpr,
                                     src.num_ranks, colocation)
    relay = split_parts(merge_relay(template), parent.shape[0], rpr) if len(fed) < K else {}

    # The proof: the template, and the relay template, tile replica 0's model data exactly.
    prove_program(template, relay or None, copies, dst_table0, d_tid, D)

    held0 = np.unique(np.repeat(np.arange(len(boxes)), boxes.hcount)[boxes.h_rank == 0])  # boxes rank 0 holds
    lower_bound_by_dst, model_bytes = bound_facts(model, sel, D, rpr, K)
    bounds = Bounds(lower_bound_by_dst=lower_bound_by_dst, model_bytes=model_bytes,
                    gatherer_held_bytes=int((boxes.n0 * boxes.n1)[held0].sum()) * model.itemsize, **balance)
    program = Program(template=template, relay=relay, box_hstart=boxes.hstart, box_hcount=boxes.hcount,
                      h_rank=boxes.h_rank, h_tensor=boxes.h_tensor, h_base=boxes.h_base, h_stride=boxes.h_stride,
                      group_box=group_box, fed=fed, choice=choice, parent=parent, stage=stage,
                      ranks_per_replica=rpr, tensors_per_replica=len(dst_table0), copies=copies)
    return Plan(src=src, dst=dst, src_tensors=src_table, dst_tensors=dst_table0.tiled(K, rpr), program=program,
                bounds=bounds, colocation=colocation, fanout=fanout, roots=len(fed) if fanout else None,
                selection=tuple(model.tensor_name(int(k)) for k in sel) if subset else None,
                coverage="exact", compile_seconds=round(time.perf_counter() - start, 4))
