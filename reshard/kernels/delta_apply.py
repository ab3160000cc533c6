"""A delta's changed elements scattered into their destination tensors in place: one Triton launch for all of them
(executors.delta's apply on GPUs).

Each entry of a delta is a block (`origin`, `cols`, row `stride`) of one destination tensor and the box-local
indices i (r * cols + c) and values of its changed elements; element i lands at origin + (i // cols) * stride +
i % cols. Entries are cut into tiles of at most BLOCK elements, rows of one int64 table (element offset of the
box from a base tensor, first element, count, cols, stride), one program per tile: the positions are computed in
the kernel, so no int64 position array is made, and every element is read and written once -- O(changed
elements), whatever the tensors' sizes. Addresses enter as element offsets from the lowest destination tensor
(`base + offset`: no integer-to-pointer casts, so Triton's interpreter runs it on CPU too). Elements move as
integers of their width (bits, not values). Imports only numpy, torch and Triton (the GPU benchmark loads this
file alone: benchmarks/refit_delta.py --apply).
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK = 1024
TABLE_COLUMNS = 5


@triton.jit
def _scatter_kernel(base, index, values, table, rows, BLOCK: tl.constexpr):
    for t in range(tl.program_id(0), rows, tl.num_programs(0)):
        origin = tl.load(table + 5 * t)
        first = tl.load(table + 5 * t + 1)
        n = tl.load(table + 5 * t + 2)
        cols = tl.load(table + 5 * t + 3)
        stride = tl.load(table + 5 * t + 4)
        offs = tl.arange(0, BLOCK)
        m = offs < n
        i = tl.load(index + first + offs, mask=m, other=0).to(tl.int64)
        v = tl.load(values + first + offs, mask=m)
        tl.store(base + origin + (i // cols) * stride + i % cols, v, mask=m)


def tiles(origin: np.ndarray, count: np.ndarray, cols: np.ndarray, stride: np.ndarray,
          block: int = BLOCK) -> np.ndarray:
    """The kernel's table: entries (element origin from the base, count, cols, stride; their elements consecutive
    in `index` / `values`) cut into tiles of at most `block` elements, int64 [tiles, 5]."""
    count = np.asarray(count, dtype=np.int64)
    per = (count + block - 1) // block
    entry = np.repeat(np.arange(len(count)), per)
    k = np.arange(len(entry)) - np.repeat(np.cumsum(per) - per, per)  # tile within its entry
    first = np.repeat(np.cumsum(count) - count, per) + k * block
    n = np.minimum(count[entry] - k * block, block)
    return np.stack([np.asarray(origin, np.int64)[entry], first, n, np.asarray(cols, np.int64)[entry],
                     np.asarray(stride, np.int64)[entry]], axis=1).astype(np.int64)


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
    table = torch.from_numpy(tiles(shift + np.asarray(origin, np.int64), count, cols, stride, block)).to(values.device)
    rows = table.shape[0]
    _scatter_kernel[(min(rows, 65535),)](base, index.contiguous(), values.contiguous(), table, rows, BLOCK=block)


__all__ = ["BLOCK", "scatter", "tiles"]
