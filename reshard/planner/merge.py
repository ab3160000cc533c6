"""Merge ops that are adjacent in memory on both sides, and sort ops into transfer order."""
from __future__ import annotations

import numpy as np

SORT_KEYS = ("stage", "src_side", "src_rank", "dst_rank", "src_tensor", "dst_tensor", "src_offset")


def sort_ops(ops: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
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
