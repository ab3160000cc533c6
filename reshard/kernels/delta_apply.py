"""A delta's changed elements scattered into their destination tensors in place, one Triton launch for all
(executors.delta on GPUs). Element i (box-local, int32) of an entry lands at origin + (i // cols) * stride + i % cols;
one program per tile of BLOCK elements finds its entry by binary search over a small int64 table, so the work is
O(changed elements). Addresses are element offsets from the lowest destination tensor (Triton's interpreter runs it
too). Imports only numpy, torch and Triton (benchmarks/refit_delta.py --apply loads this file alone).
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK = 4096  # elements a program writes per tile (256 to 4096 ran alike on an H100; fewer tiles, a smaller table)


@triton.jit
def _scatter_kernel(base, index, values, entries, num_entries, tiles, BLOCK: tl.constexpr):
    # entries: int64 rows (origin, first element, count, cols, stride, first tile); tile t belongs to the last entry
    # whose first tile is <= t (a binary search over the entries: no per-tile table to build or copy)
    for t in range(tl.program_id(0), tiles, tl.num_programs(0)):
        lo, hi = 0, num_entries
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if tl.load(entries + 6 * mid + 5) <= t:
                lo = mid
            else:
                hi = mid
        origin = tl.load(entries + 6 * lo)
        k = t - tl.load(entries + 6 * lo + 5)  # the tile within its entry
        first = tl.load(entries + 6 * lo + 1) + k * BLOCK
        n = tl.load(entries + 6 * lo + 2) - k * BLOCK
        cols = tl.load(entries + 6 * lo + 3)
        stride = tl.load(entries + 6 * lo + 4)
        offs = tl.arange(0, BLOCK)
        m = offs < n
        i = tl.load(index + first + offs, mask=m, other=0)
        v = tl.load(values + first + offs, mask=m)
        if stride == cols:  # a contiguous box: no division
            tl.store(base + origin + i.to(tl.int64), v, mask=m)
        else:  # 32-bit division (indices are int32): a 64-bit one costs several times more
            r = i // cols.to(tl.int32)
            tl.store(base + origin + r.to(tl.int64) * stride + (i - r * cols.to(tl.int32)).to(tl.int64), v, mask=m)


def entry_table(origin: np.ndarray, count: np.ndarray, cols: np.ndarray, stride: np.ndarray,
                block: int = BLOCK) -> tuple[np.ndarray, int]:
    """The kernel's entries (element origin from the base, first element in `index` / `values`, count, cols, stride,
    first tile), int64 [entries, 6], without the empty ones, and the number of tiles of at most `block` elements."""
    count = np.asarray(count, dtype=np.int64)
    per = (count + block - 1) // block
    table = np.stack([np.asarray(origin, np.int64), np.cumsum(count) - count, count, np.asarray(cols, np.int64),
                      np.asarray(stride, np.int64), np.cumsum(per) - per], axis=1)
    return np.ascontiguousarray(table[count > 0]), int(per.sum())


def scatter(targets: list[torch.Tensor], origin: np.ndarray, count: np.ndarray, cols: np.ndarray,
            stride: np.ndarray, index: torch.Tensor, values: torch.Tensor, block: int = BLOCK) -> None:
    """Write `values` into `targets` (per entry its destination tensor: flat, contiguous, all of values' dtype and
    device): entry e's elements (the next count[e] of `index` / `values`) at origin[e] + (i // cols[e]) *
    stride[e] + i % cols[e]. Asynchronous on GPUs, like any kernel. The caller has checked the indices
    (executors.delta: planner.delta.prove_delta)."""
    if not len(targets) or not int(np.sum(count)):
        return
    size = values.element_size()
    unique = {t.data_ptr(): t for t in targets}
    base = unique[min(unique)]
    shift = np.asarray([(t.data_ptr() - base.data_ptr()) // size for t in targets], dtype=np.int64)
    table, tiles = entry_table(shift + np.asarray(origin, np.int64), count, cols, stride, block)
    entries = torch.from_numpy(table).to(values.device, non_blocking=True)
    _scatter_kernel[(min(tiles, 65535),)](base, index.to(torch.int32).contiguous(), values.contiguous(), entries,
                                          len(table), tiles, BLOCK=block)


__all__ = ["BLOCK", "entry_table", "scatter"]
