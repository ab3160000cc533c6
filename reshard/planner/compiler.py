"""compile(src, dst) -> Plan: intersect destination placements with source boxes, choose senders, merge,
prove coverage, account.

Lifecycle (each step a pure function of the two layouts and the explicit options):
  1. select the canonical tensors (all, or a subset by name / layer);
  2. per canonical tensor, group the source placements into distinct boxes, each with its holders, and index
     them for interval search; intersect every destination placement of replica 0 with them;
  3. repeat replica 0's ops for every destination replica (replicas are identical layouts);
  4. choose which holder sends each op (planner.balance);
  5. merge ops adjacent in memory on both sides (planner.merge);
  6. prove that the ops write every destination model element exactly once (planner.coverage);
  7. account bytes (planner.accounting) and seal the plan with a digest.
"""
from __future__ import annotations

import math
import time
from typing import Iterable

import numpy as np

from ..errors import PlanError
from ..layouts import Layout, TensorSpec
from .accounting import Bounds
from .balance import choose_holders
from .coverage import prove_exact_coverage, rects_from_ops
from .intervals import BoxIndex
from .fanout import replica_tree_relays
from .merge import merge_adjacent
from .plan import Plan, TensorTable


def _as_2d(offset: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[tuple[int, int], tuple[int, int]]:
    if len(offset) == 1:
        return (0, offset[0]), (1, lengths[0])
    if len(offset) == 2:
        return (offset[0], offset[1]), (lengths[0], lengths[1])
    raise PlanError(f"canonical tensors of {len(offset)} dimensions are not supported (1 or 2)")


def _flat_origin(shape: tuple[int, ...], phys_offset: tuple[int, ...]) -> int:
    off = 0
    for size, o in zip(shape, phys_offset):
        off = off * size + o
    return off


class _Tables:
    """Physical tensor ids of one side: (rank, name) -> id."""

    def __init__(self) -> None:
        self.ids: dict[tuple[int, str], int] = {}
        self.ranks: list[int] = []
        self.names: list[str] = []
        self.shapes: list[tuple[int, ...]] = []

    def id(self, rank: int, name: str, shape: tuple[int, ...]) -> int:
        key = (rank, name)
        tid = self.ids.get(key)
        if tid is None:
            tid = self.ids[key] = len(self.names)
            self.ranks.append(rank)
            self.names.append(name)
            self.shapes.append(shape)
        elif self.shapes[tid] != shape:
            raise PlanError(f"layout gives rank {rank} tensor {name!r} two shapes: {self.shapes[tid]} and {shape}")
        return tid


def select_tensors(src: Layout, tensors: Iterable[str] | None, layers: Iterable[int] | None) -> list[TensorSpec]:
    chosen = list(src.model.tensors)
    if tensors is not None:
        names = set(tensors)
        known = {t.name for t in chosen}
        unknown = sorted(names - known)
        if unknown:
            raise PlanError("unknown tensor names in the selection", unknown)
        chosen = [t for t in chosen if t.name in names]
    if layers is not None:
        wanted = set(layers)
        bad = sorted(x for x in wanted if not 0 <= x < src.model.num_layers)
        if bad:
            raise PlanError(f"layers {bad} are outside [0, {src.model.num_layers})")
        chosen = [t for t in chosen if t.layer in wanted]
    if not chosen:
        raise PlanError("the selection is empty")
    return chosen


def compile_plan(src: Layout, dst: Layout, *, tensors: Iterable[str] | None = None,
                 layers: Iterable[int] | None = None, colocated: bool = False,
                 fanout: int | None = None) -> Plan:
    """Compile the refit from `src` to `dst`.

    tensors / layers: compile only these canonical tensors / these layers' tensors (a subset plan).
    colocated: destination rank d shares a device with source rank d; its bytes from there are local copies
    (and are preferred when several sources hold them).
    fanout: feed only destination replica 0 from the source and relay to the other replicas along a tree in
    which each replica forwards to at most `fanout` others (None: the source feeds every replica).
    """
    start = time.perf_counter()
    if src.model != dst.model:
        raise PlanError("source and destination describe different models",
                        [f"source: {src.model}", f"destination: {dst.model}"])
    if src.dtype != dst.dtype:
        raise PlanError(f"source dtype {src.dtype} differs from destination dtype {dst.dtype}")
    if colocated and dst.num_ranks > src.num_ranks:
        raise PlanError(f"colocated placement needs a source rank per destination rank: "
                        f"{dst.num_ranks} destination ranks, {src.num_ranks} source ranks")
    if fanout is not None and fanout < 1:
        raise PlanError(f"fanout={fanout} must be at least 1 (or None to feed every replica from the source)")
    selected = select_tensors(src, tensors, layers)
    subset = tensors is not None or layers is not None

    stabs, dtabs = _Tables(), _Tables()
    # Holders of distinct source boxes, flattened: box b's holders are holder_*[hstart[b]: hstart[b] + n].
    h_rank: list[int] = []
    h_tid: list[int] = []
    h_base: list[int] = []
    h_stride: list[int] = []
    box_hstart: list[int] = []
    box_hset: list[int] = []
    hset_ids: dict[tuple[int, ...], int] = {}
    hsets: list[tuple[int, ...]] = []
    # Replica-0 ops (source side still a box + delta) and replica-0 destination placements as rectangles.
    o_canon, o_box, o_d0, o_d1, o_dtid, o_doff, o_dstride, o_rows, o_cols = ([] for _ in range(9))
    p_tid, p_off, p_rows, p_cols = [], [], [], []
    rpr = dst.ranks_per_replica
    held_by_rank0 = 0
    problems: list[str] = []
    index_cache: dict[tuple, tuple[BoxIndex, dict]] = {}

    for t in selected:
        boxes: dict[tuple, list] = {}
        for p in src.placements(t):
            off, lens = _as_2d(p.canon_offset, p.lengths)
            if lens[0] * lens[1] == 0:
                continue
            boxes.setdefault((off, lens), []).append(p)
        box_keys = list(boxes)
        first_box = len(box_hstart)
        for key in box_keys:
            holders = sorted(boxes[key], key=lambda p: p.rank)
            ranks = tuple(p.rank for p in holders)
            if len(set(ranks)) != len(ranks):
                holders = list({p.rank: p for p in reversed(holders)}.values())[::-1]
                ranks = tuple(p.rank for p in holders)
            hs = hset_ids.get(ranks)
            if hs is None:
                hs = hset_ids[ranks] = len(hsets)
                hsets.append(ranks)
            box_hstart.append(len(h_rank))
            box_hset.append(hs)
            for p in holders:
                h_rank.append(p.rank)
                h_tid.append(stabs.id(p.rank, p.tensor, p.shape))
                h_base.append(_flat_origin(p.shape, p.phys_offset))
                h_stride.append(p.shape[-1])
            if 0 in ranks:
                held_by_rank0 += key[1][0] * key[1][1]
        # Layers and experts repeat the same geometry: index and check each distinct set of boxes once.
        geometry = tuple(box_keys)
        cached = index_cache.get(geometry)
        if cached is None:
            cached = index_cache[geometry] = (BoxIndex([k[0] for k in box_keys], [k[1] for k in box_keys]), {})
            for b, key in enumerate(box_keys):  # distinct source boxes must not overlap
                if any(other != b for other, _, _ in cached[0].query(*key)):
                    problems.append(f"source layout holds overlapping but different boxes of {t.name}: {key}")
        index, queries = cached
        for p in dst.placements(t, replica=0):
            if p.rank >= rpr:
                raise PlanError(f"destination layout places replica 0 of {t.name} outside ranks [0, {rpr})")
            off, lens = _as_2d(p.canon_offset, p.lengths)
            tid = dtabs.id(p.rank, p.tensor, p.shape)
            if lens[0] * lens[1] == 0:
                continue
            base, width = _flat_origin(p.shape, p.phys_offset), p.shape[-1]
            p_tid.append(tid)
            p_off.append(base)
            p_rows.append(lens[0])
            p_cols.append(lens[1])
            hits = queries.get((off, lens))
            if hits is None:
                hits = queries[(off, lens)] = index.query(off, lens)
            for b, ioff, ilen in hits:
                o_canon.append(t.index)
                o_box.append(first_box + b)
                o_d0.append(ioff[0] - box_keys[b][0][0])
                o_d1.append(ioff[1] - box_keys[b][0][1])
                o_dtid.append(tid)
                o_doff.append(base + (ioff[0] - off[0]) * width + (ioff[1] - off[1]))
                o_dstride.append(width)
                o_rows.append(ilen[0])
                o_cols.append(ilen[1])
    if problems:
        raise PlanError("source layout is inconsistent", problems)

    i64 = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    K, T0, N0 = dst.num_replicas, len(dtabs.names), len(o_rows)
    fed = 1 if fanout else K  # replicas the source feeds directly; the rest are relayed
    rep = np.repeat(np.arange(fed, dtype=np.int64), N0)
    tile = lambda x: np.tile(i64(x), fed)  # noqa: E731
    dst_tid0 = tile(o_dtid)
    dst_rank0 = i64(dtabs.ranks)[dst_tid0] if N0 else np.zeros(0, np.int64)
    ops = {
        "canon": tile(o_canon), "dst_tensor": dst_tid0 + rep * T0, "dst_rank": dst_rank0 + rep * rpr,
        "dst_offset": tile(o_doff), "dst_stride": tile(o_dstride), "rows": tile(o_rows), "cols": tile(o_cols),
    }
    box = tile(o_box)
    itemsize = dst.model.itemsize
    hstart, hset_of_box = i64(box_hstart), i64(box_hset)
    pos = choose_holders(ops["rows"] * ops["cols"] * itemsize, ops["dst_rank"], ops["dst_tensor"],
                         hset_of_box[box], hsets, src.num_ranks, colocated)
    h = hstart[box] + pos
    H_rank, H_tid, H_base, H_stride = i64(h_rank), i64(h_tid), i64(h_base), i64(h_stride)
    ops["stage"] = np.zeros_like(h)
    ops["src_side"] = np.zeros_like(h)
    ops["src_rank"] = H_rank[h]
    ops["src_tensor"] = H_tid[h]
    ops["src_stride"] = H_stride[h]
    ops["src_offset"] = H_base[h] + tile(o_d0) * ops["src_stride"] + tile(o_d1)
    ops = merge_adjacent(ops)
    if fanout and K > 1:
        ops = merge_adjacent(_concat(ops, replica_tree_relays(ops, K, fanout, rpr, T0)))

    # Destination tensor table for every replica.
    dst_table = TensorTable(
        tuple(r + k * rpr for k in range(K) for r in dtabs.ranks),
        tuple(dtabs.names) * K, tuple(dtabs.shapes) * K)
    src_table = TensorTable(tuple(stabs.ranks), tuple(stabs.names), tuple(stabs.shapes))
    check_source_bounds(ops, src_table, dst_table)

    width = i64([s[-1] for s in dst_table.shapes])
    height = i64([math.prod(s[:-1]) for s in dst_table.shapes])
    names = lambda tid: f"destination rank {dst_table.ranks[int(tid)]} {dst_table.names[int(tid)]!r}"  # noqa: E731
    problems = []
    op_rects = rects_from_ops(ops["dst_tensor"], ops["dst_offset"], ops["dst_stride"], ops["rows"],
                              ops["cols"], width, problems, names)
    prep = np.repeat(np.arange(K, dtype=np.int64), len(p_tid))
    p_t = np.tile(i64(p_tid), K) + prep * T0
    p_w = width[p_t] if len(p_t) else np.zeros(0, np.int64)
    p_o = np.tile(i64(p_off), K)
    piece_rects = (p_t, p_o // np.maximum(p_w, 1), p_o % np.maximum(p_w, 1), np.tile(i64(p_rows), K),
                   np.tile(i64(p_cols), K))
    prove_exact_coverage(op_rects, piece_rects, width, height, names, problems)

    per_dst = np.bincount(i64(dst_table.ranks)[p_t], weights=piece_rects[3] * piece_rects[4] * itemsize,
                          minlength=dst.num_ranks).astype(np.int64)
    bounds = Bounds(lower_bound_by_dst=tuple(per_dst.tolist()),
                    model_bytes=sum(t.numel for t in selected) * itemsize,
                    gatherer_held_bytes=held_by_rank0 * itemsize)
    return Plan(src=src, dst=dst, src_tensors=src_table, dst_tensors=dst_table, ops=ops, bounds=bounds,
                colocated=colocated, fanout=fanout, selection=tuple(t.name for t in selected) if subset else None,
                coverage="exact", compile_seconds=round(time.perf_counter() - start, 4))


def check_source_bounds(ops: dict[str, np.ndarray], src: TensorTable, dst: TensorTable) -> None:
    """Every op reads inside its source tensor (a destination tensor for relays)."""
    problems = []
    for side, table in ((0, src), (1, dst)):
        sel = np.flatnonzero(ops["src_side"] == side)
        if not len(sel):
            continue
        numel = np.asarray([math.prod(s) for s in table.shapes], dtype=np.int64)
        tid, off = ops["src_tensor"][sel], ops["src_offset"][sel]
        last = off + (ops["rows"][sel] - 1) * ops["src_stride"][sel] + ops["cols"][sel]
        for i in np.flatnonzero((off < 0) | (last > numel[tid]))[:10]:
            problems.append(f"{('source', 'relaying destination')[side]} rank {table.ranks[tid[i]]} "
                            f"{table.names[tid[i]]!r}")
    if problems:
        raise PlanError("ops read outside their source tensors", problems)


def _concat(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([a[k], b[k]]) for k in a}
