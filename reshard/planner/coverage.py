"""The coverage proof: every destination element that holds model data is written exactly once, nothing else.

Ops and destination placements become rectangles in each destination tensor's row view (rows: the leading
dimensions, columns: the last), whose columns are cut into bands at every rectangle edge. Per band, the ops' row
intervals must not overlap, nor the placements', and once touching intervals are fused the two must be equal.
Vectorized; problems are collected and reported together.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..arrays import sort_by
from ..errors import CoverageError
from .fanout import slot_copy_problems
from .merge import run_positions, run_rects


def rects_from_ops(dst_tensor: np.ndarray, dst_offset: np.ndarray, dst_stride: np.ndarray, rows: np.ndarray,
                   cols: np.ndarray, width: np.ndarray, problems: list[str], names) -> tuple[np.ndarray, ...]:
    """(tensor, row0, col0, nrows, ncols) of every op; contiguous runs that wrap rows are split."""
    W = width[dst_tensor]
    r0, c0 = dst_offset // W, dst_offset % W
    flat = rows == 1
    problems += [f"op into {names(dst_tensor[i])} has row stride {dst_stride[i]} != tensor width {W[i]}"
                 for i in np.flatnonzero(~flat & (dst_stride != W))[:5]]
    fits = flat & (c0 + cols <= W)
    whole = flat & ~fits & (c0 == 0) & (cols % W == 0)
    keep = ~(flat & ~fits & ~whole)
    extra = [(int(dst_tensor[i]), *rect)  # runs that start mid-row and wrap: split into head, body, tail
             for i in np.flatnonzero(~keep) for rect in run_rects(int(dst_offset[i]), int(cols[i]), int(W[i]))]
    out = [x[keep] for x in (dst_tensor, r0, c0, np.where(whole, cols // W, rows), np.where(whole, W, cols))]
    if extra:
        e = np.asarray(extra, dtype=np.int64)
        out = [np.concatenate([o, e[:, k]]) for k, o in enumerate(out)]
    problems += [f"op into {names(out[0][i])} writes columns past the tensor's width"
                 for i in np.flatnonzero((out[2] < 0) | (out[2] + out[4] > width[out[0]]))[:5]]
    return tuple(out)


def sorted_unique(a: np.ndarray) -> np.ndarray:
    """np.unique by sorting (numpy's hash-based unique is slow on millions of int64)."""
    a = np.sort(a)
    return a[np.concatenate([[True], a[1:] != a[:-1]])] if len(a) else a


def band_segments(t, r0, c0, nr, nc, key_base, bounds_keys):
    """Explode rectangles into per-band row intervals, sorted by (band, row)."""
    lo = np.searchsorted(bounds_keys, t * key_base + c0)
    count = np.searchsorted(bounds_keys, t * key_base + c0 + nc) - lo
    if (count == 1).all():  # every rectangle lies in one band: nothing to explode
        band, start, end = lo, r0, r0 + nr
    else:
        idx = np.repeat(np.arange(len(t)), count)
        band = np.repeat(lo, count) + run_positions(count)
        start, end = r0[idx], r0[idx] + nr[idx]
    order = sort_by((band, start))
    return band[order], start[order], end[order]


def overlapping(band, start, end):
    """Indices i where interval i + 1 starts inside interval i of the same band (segments sorted by band, start)."""
    return np.flatnonzero((band[1:] == band[:-1]) & (start[1:] < end[:-1]))


def _fuse(band, start, end):
    if not len(band):
        return band, start, end
    new = np.concatenate([[True], (band[1:] != band[:-1]) | (start[1:] != end[:-1])])
    first = np.flatnonzero(new)
    last = np.concatenate([first[1:] - 1, [len(band) - 1]])
    return band[first], start[first], end[last]


def prove_exact_coverage(ops_rects: tuple[np.ndarray, ...], piece_rects: tuple[np.ndarray, ...],
                         width: np.ndarray, height: np.ndarray, names, problems: list[str]) -> None:
    """Raise CoverageError listing every problem unless ops tile the placements exactly."""
    ot, orow, ocol, onr, onc = ops_rects
    pt, prow, pcol, pnr, pnc = piece_rects
    for label, t, r, nr in (("op", ot, orow, onr), ("placement", pt, prow, pnr)):
        problems += [f"{label} in {names(t[i])} covers rows [{r[i]}, {r[i] + nr[i]}) past its {height[t[i]]} rows"
                     for i in np.flatnonzero((r < 0) | (r + nr > height[t]))[:5]]
    _failed("coverage proof failed", problems)
    key_base = int(width.max(initial=0)) + 1
    # Column cuts: every tensor's two sides, and the sides of every rectangle narrower than its tensor.
    tids = np.arange(len(width), dtype=np.int64)
    cuts = [tids * key_base, tids * key_base + width]
    for t, c, n in ((ot, ocol, onc), (pt, pcol, pnc)):
        part = np.flatnonzero(n != width[t])
        cuts += [t[part] * key_base + c[part], t[part] * key_base + c[part] + n[part]]
    edges = sorted_unique(np.concatenate(cuts))
    ob, os_, oe = band_segments(ot, orow, ocol, onr, onc, key_base, edges)
    pb, ps, pe = band_segments(pt, prow, pcol, pnr, pnc, key_base, edges)

    def where(b, s, e):
        k = int(edges[b])
        t = k // key_base
        c0, c1 = k % key_base, int(edges[b + 1]) % key_base
        return f"{names(t)} rows [{s}, {e}) cols [{c0}, {c1})"

    problems += [f"written twice: {where(ob[i + 1], os_[i + 1], min(oe[i], oe[i + 1]))}"
                 for i in overlapping(ob, os_, oe)[:10]]
    problems += [f"destination layout places two boxes at {where(pb[i + 1], ps[i + 1], pe[i])}"
                 for i in overlapping(pb, ps, pe)[:10]]
    _failed("coverage proof failed", problems)
    fo, fp = _fuse(ob, os_, oe), _fuse(pb, ps, pe)
    if len(fo[0]) == len(fp[0]) and all(np.array_equal(a, b) for a, b in zip(fo, fp)):
        return
    # Report the difference: data not written, or writes outside model data.
    o_set = set(zip(*(x.tolist() for x in fo)))
    p_set = set(zip(*(x.tolist() for x in fp)))
    problems += [f"model data not (wholly) written: {where(*x)}" for x in sorted(p_set - o_set)[:10]]
    problems += [f"write outside model data (or partial): {where(*x)}" for x in sorted(o_set - p_set)[:10]]
    raise CoverageError("coverage proof failed", problems)


def prove_program(template: dict[str, np.ndarray], relay: dict[str, np.ndarray] | None,
                  copies: dict[str, np.ndarray], dst_table0: Any, d_tid: np.ndarray, D: Any) -> None:
    """Raise CoverageError listing the problems unless the template, and the relay template (None: no replica is
    relayed), each with the EPLB slot copies (program.COPY_COLUMNS; {} without), tile replica 0's model data
    exactly (`D`: its placements with data, `d_tid` their ids in `dst_table0`), and every copy reads what it writes.
    """
    width = dst_table0.kind_array(lambda _, shape: shape[-1])
    height = dst_table0.kind_array(lambda _, shape: int(np.prod(shape[:-1], dtype=np.int64)))
    names = lambda t: f"destination rank {dst_table0.rank[int(t)]} {dst_table0.name(int(t))!r}"  # noqa: E731
    row, col = np.divmod(D.origin, np.maximum(width[d_tid], 1))  # each piece's origin as (row, column)
    piece_rects = (d_tid, row, col, D.n0, D.n1)
    for ops in (template, relay) if relay is not None else (template,):
        problems: list[str] = []
        rects = rects_from_ops(*(np.concatenate([ops[c], copies[c]]) if copies else ops[c]
                                 for c in ("dst_tensor", "dst_offset", "dst_stride", "rows", "cols")),
                               width, problems, names)
        prove_exact_coverage(rects, piece_rects, width, height, names, problems)
    _failed("EPLB slot copies read other elements than they write", slot_copy_problems(copies, d_tid, D) if copies
            else [])


def prove_expert_slots(stacks: Any, dst_table0: Any, d_tid: np.ndarray, D: Any, whole: bool = True,
                       ops: dict[str, np.ndarray] | None = None, canonical: Any = None) -> None:
    """Prove what an expert-parallel destination's slots receive. Raises CoverageError listing the problems.

    `stacks`: the destination's `expert_stacks()` (None: nothing to prove), the logical expert in each slot of
    every stacked expert tensor of replica 0, read from the placement. `D`: replica 0's placements with data,
    `d_tid` their ids in `dst_table0`.
      1. Every slot holds model data: with `whole` (a whole-model plan) each slot is wholly covered, in any plan
         every replica of a logical expert as much as the others.
      2. Given `ops` (the template before merging, with each op's canonical origin `canon_r0`, `canon_c0`) and the
         model's `canonical` table: every op into a slot lies inside it and reads the canonical tensor of the
         slot's layer and expert, and every replica of an expert receives the same canonical boxes at the same
         offsets. Merging changes no byte's source, so the merged template writes the same.
    """
    slots = _Slots(stacks, dst_table0, whole) if stacks is not None and len(stacks.names) else None
    if slots is not None and len(slots.tid):
        slots.prove_filled(d_tid, D, whole)
        if ops is not None:
            slots.prove_ops(ops, canonical)


def _failed(message: str, problems: list[str]) -> None:
    """Raise CoverageError(message) listing `problems`, if there are any."""
    if problems:
        raise CoverageError(message, problems)


class _Slots:
    """The stacked expert tensors of `stacks` found in replica 0's `table` (`tid`, `layer`), each of S slots, each
    checked to be a tensor of S slots (one missing only from a subset plan). Global slot g is slot g % S of stack
    g // S, holding logical expert `logical[g]`; `replica0[g]` is the lowest slot of its group of replicas (the
    slots of one tensor name, layer and w13 / w2, holding one logical expert)."""

    def __init__(self, stacks: Any, table: Any, whole: bool):
        tid = table.find(stacks.ranks, stacks.names)  # each stack's table id (tens of thousands at EP64)
        found = tid >= 0
        S = self.S = stacks.logical.shape[1]
        wrong = np.flatnonzero(found & (table.kind_array(lambda _, shape: shape[0])[np.maximum(tid, 0)] != S))
        missing = np.flatnonzero(~found) if whole else np.zeros(0, np.int64)  # a subset plan may leave a layer out
        _failed("expert slot proof failed", [
            f"destination rank {stacks.ranks[k]} {stacks.names[k]!r}: the placement gives it {S} expert slots, the "
            f"layout {'no such tensor' if tid[k] < 0 else f'shape {table.shape(int(tid[k]))}'}"
            for k in np.concatenate([missing, wrong])[:10]])
        kept = np.flatnonzero(found)
        self.table, self.tid, self.layer = table, tid[kept], stacks.layers[kept]
        self.logical = np.ascontiguousarray(stacks.logical[kept]).reshape(-1)
        self.numel = table.kind_array(lambda _, shape: math.prod(shape[1:]))[self.tid]  # elements of a slot, per stack
        self.stack_of = np.full(len(table), -1, dtype=np.int64)  # per table id, its stack; -1: another tensor
        self.stack_of[self.tid] = np.arange(len(self.tid))
        name_id = np.unique(np.asarray(stacks.names), return_inverse=True)[1].reshape(-1)[kept]
        _, first, group = np.unique(np.repeat(name_id, S) * (int(self.logical.max(initial=0)) + 1) + self.logical,
                                    return_index=True, return_inverse=True)
        self.replica0 = first[group.reshape(-1)]

    def label(self, g: int) -> str:
        """Global slot `g` in words."""
        t = int(self.tid[g // self.S])
        return (f"destination rank {self.table.rank[t]} {self.table.name(t)!r} slot {g % self.S} "
                f"(logical expert {self.logical[g]})")

    def prove_filled(self, d_tid: np.ndarray, D: Any, whole: bool) -> None:
        """1. of `prove_expert_slots`: the placements' model data per slot (they do not overlap: the exact coverage
        proof says so)."""
        sel = np.flatnonzero(self.stack_of[d_tid] >= 0)
        k = self.stack_of[d_tid[sel]]
        filled = np.bincount(k * self.S + D.origin[sel] // self.numel[k], weights=D.n0[sel] * D.n1[sel],
                             minlength=len(self.logical)).astype(np.int64)
        slot_numel, r0 = np.repeat(self.numel, self.S), self.replica0
        short = np.flatnonzero((filled != slot_numel) if whole else (filled != filled[r0]))
        _failed("expert slot proof failed: a physical slot is not (like its replicas) model data", [
            f"{self.label(int(g))}: the layout places {filled[g]} of its {slot_numel[g]} elements"
            + ("" if whole else f", its replica {self.label(int(r0[g]))} {filled[r0[g]]}") for g in short[:10]])

    def prove_ops(self, ops: dict[str, np.ndarray], canonical: Any) -> None:
        """2. of `prove_expert_slots`: the ops into slots lie inside one slot, read the slot's expert, and are the
        same for every replica."""
        sel = np.flatnonzero(self.stack_of[ops["dst_tensor"]] >= 0)
        k = self.stack_of[ops["dst_tensor"][sel]]
        off, rows, cols, stride, canon = (ops[c][sel] for c in ("dst_offset", "rows", "cols", "dst_stride", "canon"))
        local = off // self.numel[k]
        g = k * self.S + local
        layer_of, expert_of = canonical.layer, canonical.expert
        across = np.flatnonzero((off + (rows - 1) * stride + cols - 1) // self.numel[k] != local)
        wrong = np.flatnonzero((layer_of[canon] != self.layer[k]) | (expert_of[canon] != self.logical[g]))
        _failed("expert slot proof failed: a slot receives bytes of another expert",
                [f"{self.label(int(g[i]))}: an op runs past the slot's end" for i in across[:10]]
                + [f"{self.label(int(g[i]))}: written from canonical tensor {int(canon[i])} (layer "
                   f"{layer_of[canon[i]]}, expert {expert_of[canon[i]]})" for i in wrong[:10]])
        # each slot's ops, sorted by what they carry, must equal op for op those of its group's first slot
        key = [canon, ops["canon_r0"][sel], ops["canon_c0"][sel], rows, cols, off - local * self.numel[k], stride]
        order = sort_by((g, *key))
        g, key, r0 = g[order], [x[order] for x in key], self.replica0
        per_slot = np.bincount(g, minlength=len(self.logical))
        start = np.cumsum(per_slot) - per_slot
        problems = [f"{self.label(int(x))}: receives {per_slot[x]} pieces, its replica {self.label(int(r0[x]))} "
                    f"{per_slot[r0[x]]}" for x in np.flatnonzero(per_slot != per_slot[r0])[:10]]
        if not problems and len(g):
            ref = start[r0[g]] + (np.arange(len(g)) - start[g])
            differ = np.flatnonzero(np.any([x != x[ref] for x in key], axis=0))
            problems += [f"{self.label(int(g[i]))}: receives other bytes than its replica {self.label(int(r0[g[i]]))}"
                         for i in differ[:10]]
        _failed("expert slot proof failed: replicas of one expert receive different bytes", problems)
