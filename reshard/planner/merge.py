"""Merge ops that are adjacent in memory on both sides, and sort ops into transfer order."""
from __future__ import annotations

import numpy as np

from ..arrays import sort_by, unique_inverse

SORT_KEYS = ("stage", "src_side", "src_rank", "dst_rank", "src_tensor", "dst_tensor", "src_offset")


def run_positions(count: np.ndarray) -> np.ndarray:
    """For runs of `count` elements laid end to end, each element's position inside its run."""
    return np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)


def distinct(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct values of non-negative `key`, ascending; each entry's index among them): counted where they
    span at most 2**26 values (no sort), else sorted."""
    span = int(key.max(initial=-1)) + 1
    if span <= 1 << 26:
        present = np.bincount(key, minlength=span) > 0
        return np.flatnonzero(present), (np.cumsum(present) - 1)[key]
    first, inverse = unique_inverse((key,))
    return key[first], inverse


def run_rects(start: int, length: int, width: int) -> list[tuple[int, int, int, int]]:
    """The elements [start, start + length) of rows `width` long, row-major, as at most three rectangles (row, col,
    rows, cols): the rest of the first row, whole rows, the start of the last row."""
    r, c = divmod(start, width)
    out = []
    if c:
        out.append((r, c, 1, min(width - c, length)))
        length -= out[-1][3]
        r += 1
    if length // width:
        out.append((r, 0, length // width, width))
        r += length // width
    if length % width:
        out.append((r, 0, 1, length % width))
    return out


def sort_ops(ops: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The ops in transfer order (SORT_KEYS): each (stage, sender, receiver) one contiguous range."""
    order = np.lexsort(tuple(ops[k] for k in reversed(SORT_KEYS)))
    return {k: v[order] for k, v in ops.items()}


def _flatten(ops: dict[str, np.ndarray], flat: np.ndarray, strides: tuple[str, ...]) -> dict[str, np.ndarray]:
    """`ops` with the blocks marked `flat` as one contiguous run each: rows 1, cols (and `strides`) all elements."""
    ops = dict(ops)
    ops["cols"] = np.where(flat, ops["rows"] * ops["cols"], ops["cols"])
    ops["rows"] = np.where(flat, 1, ops["rows"])
    for k in strides:
        ops[k] = np.where(flat, ops["cols"], ops[k])
    return ops


def _adjacent(rows: np.ndarray, cols: np.ndarray, off: np.ndarray, stride: np.ndarray) -> np.ndarray:
    """Whether op i + 1 starts, on one side, where op i ends: two runs end to end, or two blocks of one width and
    stride, one below the other."""
    fp, fn = rows[:-1] == 1, rows[1:] == 1
    return ((fp & fn & (off[1:] == off[:-1] + cols[:-1]))
            | (~fp & ~fn & (cols[1:] == cols[:-1]) & (stride[1:] == stride[:-1])
               & (off[1:] == off[:-1] + rows[:-1] * stride[:-1])))


def _fuse(ops: dict[str, np.ndarray], joins: np.ndarray, strides: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Each chain of joined neighbours fused into its first op (runs add cols, blocks add rows)."""
    if not joins.any():
        return ops
    starts = np.flatnonzero(np.concatenate([[True], ~joins]))
    out = {k: v[starts] for k, v in ops.items()}
    flat = out["rows"] == 1
    out["cols"] = np.where(flat, np.add.reduceat(ops["cols"], starts), out["cols"])
    out["rows"] = np.where(flat, 1, np.add.reduceat(ops["rows"], starts))
    for k in strides:
        out[k] = np.where(flat, out["cols"], out[k])
    return out


def _merge(ops: dict[str, np.ndarray], keys: tuple[str, ...], sides: tuple[str, ...]) -> dict[str, np.ndarray]:
    """`ops` sorted by `keys`, then the first side's offset; chains of neighbours that agree on `keys` and start,
    on every one of `sides` ("src", "dst"), where the previous one ends fused into one op. Blocks whose rows are
    whole on every side become one contiguous run first."""
    strides = tuple(f"{s}_stride" for s in sides)
    ops = _flatten(ops, (ops["rows"] == 1) | np.all([ops["cols"] == ops[k] for k in strides], axis=0), strides)
    ops = {k: v[sort_by(tuple(ops[c] for c in (*keys, f"{sides[0]}_offset")))] for k, v in ops.items()}
    if len(ops["rows"]) < 2:
        return ops
    joins = np.all([ops[k][1:] == ops[k][:-1] for k in keys]
                   + [_adjacent(ops["rows"], ops["cols"], ops[f"{s}_offset"], ops[f"{s}_stride"]) for s in sides],
                   axis=0)
    return _fuse(ops, joins, strides)


def merge_adjacent(ops: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`_merge` on both sides, sorted by SORT_KEYS: contiguous runs fuse by adding their lengths, strided blocks
    of one width and stride by adding rows; a fused op keeps the first op's canonical tensor id."""
    return _merge(ops, SORT_KEYS[:-1], ("src", "dst"))


def merge_template(t: dict[str, np.ndarray], box_hset: np.ndarray, box_stride: np.ndarray, box_hstart: np.ndarray,
                   box_hcount: np.ndarray, h_tensor: np.ndarray, h_base: np.ndarray,
                   h_stride: np.ndarray) -> dict[str, np.ndarray]:
    """Merge template ops adjacent in memory on both sides *whichever holder sends them*; number the groups.

    Ops of one (holder set, destination tensor) go to one holder together, so only they may merge, and only when
    they are adjacent in every holder's tensor. A box whose holders have different row strides is never
    flattened or merged (box_stride -1). Returns the ops sorted by (holder set, destination tensor, offset) with
    a "group" column numbering the (holder set, destination tensor) runs.
    """
    stride = box_stride[t["box"]]
    t = _flatten(t, (t["rows"] == 1) | ((t["cols"] == t["dst_stride"]) & (t["cols"] == stride)), ("dst_stride",))
    t["hset"] = box_hset[t["box"]]
    t = {k: v[sort_by((t["hset"], t["dst_tensor"], t["dst_offset"]))] for k, v in t.items()}
    rows, cols, box = t["rows"], t["cols"], t["box"]
    joins = np.zeros(max(len(rows) - 1, 0), dtype=bool)
    if len(rows) >= 2:
        s = box_stride[box]
        same = (t["hset"][1:] == t["hset"][:-1]) & (t["dst_tensor"][1:] == t["dst_tensor"][:-1])
        cand = np.flatnonzero(same & _adjacent(rows, cols, t["dst_offset"], t["dst_stride"])
                              & ((rows[:-1] == 1) | ((s[1:] == s[:-1]) & (s[:-1] >= 0))))
        step = np.where(rows == 1, cols, rows * s)

        def follows(i: np.ndarray, pos: np.ndarray | int, pair: np.ndarray | slice) -> np.ndarray:
            """Whether, at holder position `pos`, op i + 1 reads right after op i in the same source tensor."""
            j = i + 1
            hi, hj = box_hstart[box[i]][pair] + pos, box_hstart[box[j]][pair] + pos
            oi = h_base[hi] + t["src_d0"][i][pair] * h_stride[hi] + t["src_d1"][i][pair]
            oj = h_base[hj] + t["src_d0"][j][pair] * h_stride[hj] + t["src_d1"][j][pair]
            return (h_tensor[hi] == h_tensor[hj]) & (oj == oi + step[i][pair])

        # Holder position 0 first (cheap, and rules out most candidates), then every position of the pair's
        # (shared) holder set.
        cand = cand[follows(cand, 0, slice(None))]
        if len(cand):
            cnt = box_hcount[box[cand]]
            pair = np.repeat(np.arange(len(cand)), cnt)
            bad = np.bincount(pair[~follows(cand, run_positions(cnt), pair)], minlength=len(cand))
            joins[cand[bad == 0]] = True
    t = _fuse(t, joins, ("dst_stride",))
    hset = t.pop("hset")
    change = np.ones(len(hset), dtype=bool)
    change[1:] = (hset[1:] != hset[:-1]) | (t["dst_tensor"][1:] != t["dst_tensor"][:-1])
    t["group"] = np.cumsum(change) - 1
    return t


def merge_relay(t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The template's destination regions, merged where adjacent: what a parent replica forwards to a child
    (source and destination are the same regions of identical tensors, so destination adjacency suffices)."""
    return _merge({k: t[k] for k in ("canon", "dst_rank", "dst_tensor", "dst_offset", "dst_stride", "rows", "cols")},
                  ("dst_tensor",), ("dst",))
