"""Choosing among sources that hold the same bytes, so that the busiest sender moves as little as possible.

Ops whose bytes have one holder are fixed. The rest are grouped by (destination tensor, set of holders): a
group goes to one holder as a unit so that ops adjacent in memory stay mergeable. Groups are assigned
greedily, largest first, to the holder with the least egress so far (longest-processing-time greedy: the
busiest sender ends within 4/3 of the best assignment of these groups, plus the largest group). When the
destination shares a device with a holder (colocated plans), that holder is taken: its bytes are a local
copy and cost no link.
"""
from __future__ import annotations

import numpy as np


def choose_holders(op_bytes: np.ndarray, op_dst_rank: np.ndarray, op_dst_tensor: np.ndarray,
                   op_hset: np.ndarray, hsets: list[tuple[int, ...]], num_src: int,
                   colocated: bool) -> np.ndarray:
    """Position, inside each op's holder set, of the holder that sends it."""
    sizes = np.fromiter((len(h) for h in hsets), dtype=np.int64, count=len(hsets))
    pos = np.zeros(len(op_bytes), dtype=np.int64)
    fixed = sizes[op_hset] == 1
    egress = np.zeros(num_src, dtype=np.int64)
    if fixed.any():
        first = np.fromiter((h[0] for h in hsets), dtype=np.int64, count=len(hsets))[op_hset[fixed]]
        sent = ~(colocated & (first == op_dst_rank[fixed]))
        np.add.at(egress, first[sent], op_bytes[fixed][sent])
    free = np.flatnonzero(~fixed)
    if not len(free):
        return pos
    key = op_dst_tensor[free] * len(hsets) + op_hset[free]
    groups, inverse = np.unique(key, return_inverse=True)
    group_bytes = np.bincount(inverse, weights=op_bytes[free]).astype(np.int64)
    group_hset = groups % len(hsets)
    group_dst = np.zeros(len(groups), dtype=np.int64)
    group_dst[inverse] = op_dst_rank[free]
    choice = np.zeros(len(groups), dtype=np.int64)
    for g in np.lexsort((groups, -group_bytes)).tolist():  # largest first, ties by key: deterministic
        holders = hsets[group_hset[g]]
        if colocated and group_dst[g] in holders:
            choice[g] = holders.index(int(group_dst[g]))
            continue
        loads = egress[list(holders)]
        k = int(np.argmin(loads))
        choice[g] = k
        egress[holders[k]] += group_bytes[g]
    pos[free] = choice[inverse]
    return pos
