"""Merge ops that are adjacent in memory on both sides, and sort ops into transfer order."""
from __future__ import annotations

import numpy as np

from ..arrays import sort_by

SORT_KEYS = ("stage", "src_side", "src_rank", "dst_rank", "src_tensor", "dst_tensor", "src_offset")


def sort_ops(ops: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The ops in transfer order (SORT_KEYS): each (stage, sender, receiver) one contiguous range."""
    order = np.lexsort(tuple(ops[k] for k in reversed(SORT_KEYS)))
    return {k: v[order] for k, v in ops.items()}


def normalize_contiguous(ops: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Blocks whose rows are whole on both sides are one contiguous run: rows=1, cols=all elements."""
    ops = dict(ops)
    rows, cols = ops["rows"], ops["cols"]
    flat = (rows == 1) | ((cols == ops["src_stride"]) & (cols == ops["dst_stride"]))
    ops["cols"] = np.where(flat, rows * cols, cols)
    ops["rows"] = np.where(flat, 1, rows)
    ops["src_stride"] = np.where(flat, ops["cols"], ops["src_stride"])
    ops["dst_stride"] = np.where(flat, ops["cols"], ops["dst_stride"])
    return ops


def merge_adjacent(ops: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Fuse chains of ops where each starts, on both sides, exactly where the previous one ends.

    Contiguous runs fuse by adding their lengths; strided blocks with the same width and strides fuse by
    adding rows. A fused op keeps the first op's canonical tensor id.
    """
    ops = sort_ops(normalize_contiguous(ops))
    n = len(ops["rows"])
    if n < 2:
        return ops
    rows, cols = ops["rows"], ops["cols"]
    s_off, d_off, s_str, d_str = ops["src_offset"], ops["dst_offset"], ops["src_stride"], ops["dst_stride"]
    same = np.ones(n - 1, dtype=bool)
    for k in ("stage", "src_side", "src_rank", "dst_rank", "src_tensor", "dst_tensor"):
        same &= ops[k][1:] == ops[k][:-1]
    flat_prev, flat_next = rows[:-1] == 1, rows[1:] == 1
    contiguous = (flat_prev & flat_next & (s_off[1:] == s_off[:-1] + cols[:-1])
                  & (d_off[1:] == d_off[:-1] + cols[:-1]))
    strided = (~flat_prev & ~flat_next & (cols[1:] == cols[:-1]) & (s_str[1:] == s_str[:-1])
               & (d_str[1:] == d_str[:-1]) & (s_off[1:] == s_off[:-1] + rows[:-1] * s_str[:-1])
               & (d_off[1:] == d_off[:-1] + rows[:-1] * d_str[:-1]))
    joins = same & (contiguous | strided)
    if not joins.any():
        return ops
    starts = np.flatnonzero(np.concatenate([[True], ~joins]))
    merged = {k: v[starts] for k, v in ops.items()}
    flat = merged["rows"] == 1
    merged["cols"] = np.where(flat, np.add.reduceat(cols, starts), merged["cols"])
    merged["rows"] = np.where(flat, 1, np.add.reduceat(rows, starts))
    merged["src_stride"] = np.where(flat, merged["cols"], merged["src_stride"])
    merged["dst_stride"] = np.where(flat, merged["cols"], merged["dst_stride"])
    return merged


def _fuse_runs(cols: dict[str, np.ndarray], joins: np.ndarray) -> dict[str, np.ndarray]:
    """Fuse each chain of joined neighbours into its first op (contiguous runs add cols, blocks add rows)."""
    if not joins.any():
        return cols
    starts = np.flatnonzero(np.concatenate([[True], ~joins]))
    out = {k: v[starts] for k, v in cols.items()}
    flat = out["rows"] == 1
    out["cols"] = np.where(flat, np.add.reduceat(cols["cols"], starts), out["cols"])
    out["rows"] = np.where(flat, 1, np.add.reduceat(cols["rows"], starts))
    out["dst_stride"] = np.where(flat, out["cols"], out["dst_stride"])
    return out


def merge_template(t: dict[str, np.ndarray], box_hset: np.ndarray, box_stride: np.ndarray, box_hstart: np.ndarray,
                   box_hcount: np.ndarray, h_tensor: np.ndarray, h_base: np.ndarray,
                   h_stride: np.ndarray) -> dict[str, np.ndarray]:
    """Merge template ops adjacent in memory on both sides *whichever holder sends them*; number the groups.

    Ops of one (holder set, destination tensor) go to one holder together, so only they may merge, and only when
    they are adjacent in every holder's tensor. A box whose holders have different row strides is never
    flattened or merged (box_stride -1). Returns the ops sorted by (holder set, destination tensor, offset) with
    a "group" column numbering the (holder set, destination tensor) runs.
    """
    t = dict(t)
    stride = box_stride[t["box"]]
    flat = (t["rows"] == 1) | ((t["cols"] == t["dst_stride"]) & (t["cols"] == stride))
    t["cols"] = np.where(flat, t["rows"] * t["cols"], t["cols"])
    t["rows"] = np.where(flat, 1, t["rows"])
    t["dst_stride"] = np.where(flat, t["cols"], t["dst_stride"])
    hset = box_hset[t["box"]]
    order = sort_by((hset, t["dst_tensor"], t["dst_offset"]))
    hset = hset[order]
    need = ("box", "rows", "cols", "dst_offset", "dst_stride", "dst_tensor", "src_d0", "src_d1")
    u = {k: t[k][order] for k in need}  # the columns the merge test reads, in merge order
    n = len(hset)
    if n >= 2:
        rows, cols, off, dstr = u["rows"], u["cols"], u["dst_offset"], u["dst_stride"]
        s = box_stride[u["box"]]
        same = (hset[1:] == hset[:-1]) & (u["dst_tensor"][1:] == u["dst_tensor"][:-1])
        fp, fn = rows[:-1] == 1, rows[1:] == 1
        flat_dst = fp & fn & (off[1:] == off[:-1] + cols[:-1])
        block_dst = (~fp & ~fn & (cols[1:] == cols[:-1]) & (dstr[1:] == dstr[:-1]) & (s[1:] == s[:-1])
                     & (s[:-1] >= 0) & (off[1:] == off[:-1] + rows[:-1] * dstr[:-1]))
        cand = np.flatnonzero(same & (flat_dst | block_dst))
        step = np.where(rows == 1, cols, rows * s)
        # The source side at holder position 0 first (cheap, and rules out most candidates), then at every
        # position of the pair's (shared) holder set.
        i, j = cand, cand + 1
        hi, hj = box_hstart[u["box"][i]], box_hstart[u["box"][j]]
        oi = h_base[hi] + u["src_d0"][i] * h_stride[hi] + u["src_d1"][i]
        oj = h_base[hj] + u["src_d0"][j] * h_stride[hj] + u["src_d1"][j]
        cand = cand[(h_tensor[hi] == h_tensor[hj]) & (oj == oi + step[i])]
        joins = np.zeros(n - 1, dtype=bool)
        if len(cand):
            i, j = cand, cand + 1
            bi, bj = u["box"][i], u["box"][j]
            cnt = box_hcount[bi]
            pair = np.repeat(np.arange(len(cand)), cnt)
            pos = np.arange(len(pair)) - np.repeat(np.cumsum(cnt) - cnt, cnt)
            hi, hj = box_hstart[bi][pair] + pos, box_hstart[bj][pair] + pos
            oi = h_base[hi] + u["src_d0"][i][pair] * h_stride[hi] + u["src_d1"][i][pair]
            oj = h_base[hj] + u["src_d0"][j][pair] * h_stride[hj] + u["src_d1"][j][pair]
            ok = (h_tensor[hi] == h_tensor[hj]) & (oj == oi + step[i][pair])
            bad = np.bincount(pair[~ok], minlength=len(cand))
            joins[cand[bad == 0]] = True
        if joins.any():
            starts = np.flatnonzero(np.concatenate([[True], ~joins]))
            keep = order[starts]
            flat = rows[starts] == 1
            merged_cols = np.where(flat, np.add.reduceat(cols, starts), cols[starts])
            merged_rows = np.where(flat, 1, np.add.reduceat(rows, starts))
            t = {k: (u[k][starts] if k in u else v[keep]) for k, v in t.items()}
            t["cols"], t["rows"] = merged_cols, merged_rows
            t["dst_stride"] = np.where(flat, merged_cols, t["dst_stride"])
            hset = hset[starts]
        else:
            t = {k: (u[k] if k in u else v[order]) for k, v in t.items()}
    else:
        t = {k: v[order] for k, v in t.items()}
    change = np.ones(len(hset), dtype=bool)
    if len(hset) > 1:
        change[1:] = (hset[1:] != hset[:-1]) | (t["dst_tensor"][1:] != t["dst_tensor"][:-1])
    t["group"] = np.cumsum(change) - 1
    return t


def merge_relay(t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The template's destination regions, merged where adjacent: what a parent replica forwards to a child
    (source and destination are the same regions of identical tensors, so destination adjacency suffices)."""
    cols = {k: t[k] for k in ("canon", "dst_rank", "dst_tensor", "dst_offset", "dst_stride", "rows", "cols")}
    flat = (cols["rows"] == 1) | (cols["cols"] == cols["dst_stride"])
    cols["cols"] = np.where(flat, cols["rows"] * cols["cols"], cols["cols"])
    cols["rows"] = np.where(flat, 1, cols["rows"])
    cols["dst_stride"] = np.where(flat, cols["cols"], cols["dst_stride"])
    order = sort_by((cols["dst_tensor"], cols["dst_offset"]))
    cols = {k: v[order] for k, v in cols.items()}
    if len(order) < 2:
        return cols
    rows, c, off, st = cols["rows"], cols["cols"], cols["dst_offset"], cols["dst_stride"]
    same = cols["dst_tensor"][1:] == cols["dst_tensor"][:-1]
    fp, fn = rows[:-1] == 1, rows[1:] == 1
    joins = same & ((fp & fn & (off[1:] == off[:-1] + c[:-1]))
                    | (~fp & ~fn & (c[1:] == c[:-1]) & (st[1:] == st[:-1]) & (off[1:] == off[:-1] + rows[:-1] * st[:-1])))
    return _fuse_runs(cols, joins)
