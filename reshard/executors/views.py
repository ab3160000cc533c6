"""Copy programs as views of real tensors: built once, reused at every refit.

Each strided 3-D copy becomes a (destination, source) view pair, read as 8-byte words where alignment allows.
Small pairs run as `torch._foreach_copy_` groups (contiguous ones fused into few launches, strided ones looped in
C++); large contiguous pairs each as one `copy_` (a plain memcpy on CUDA, faster than the foreach kernel there).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from .copies import Copies, copy_view

WORD_BYTES = 8
LARGE_BYTES = 1 << 20  # contiguous copies at least this large run as single copy_ calls (a memcpy on GPUs)
WORD_DTYPES = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def word_elements(copies: Copies, itemsize: int) -> np.ndarray:
    """Per copy, how many elements one 8-byte word may hold given its offsets, steps, strides and width."""
    most = max(WORD_BYTES // itemsize, 1)
    c = copies.cols
    g = np.full(len(copies), most, dtype=np.int64)
    for col, used in (("src_off", True), ("dst_off", True), ("cols", True),  # steps and strides where they apply
                      ("src_step", c["n"] > 1), ("dst_step", c["n"] > 1),
                      ("src_stride", c["rows"] > 1), ("dst_stride", c["rows"] > 1)):
        g = np.gcd(g, np.where(used, c[col], 0))
    return g & -g  # the largest power of two dividing it (elements per word are powers of two)


class Memory:
    """Flat views of named memory, and views of the same bytes as wider words where alignment allows."""

    def __init__(self, flat: Callable[[int, int], torch.Tensor], itemsize: int) -> None:
        self.flat, self.itemsize = flat, itemsize
        self._wide: dict[tuple[int, int, int], torch.Tensor | None] = {}

    def get(self, kind: int, i: int, per_word: int) -> torch.Tensor | None:
        """The memory as words of `per_word` elements, or None if its alignment does not allow them."""
        t = self.flat(kind, i)
        if per_word == 1:
            return t
        key = (kind, i, per_word)
        if key not in self._wide:
            dtype = WORD_DTYPES.get(per_word * self.itemsize)
            ok = (dtype is not None and t.storage_offset() % per_word == 0 and t.numel() % per_word == 0
                  and t.data_ptr() % (per_word * self.itemsize) == 0)
            self._wide[key] = t.view(dtype) if ok else None
        return self._wide[key]


class CopyViews:
    """A program's copies as view pairs; `run()` launches them on the current stream."""

    __slots__ = ("large", "groups", "count")

    def __init__(self, large: list[tuple], groups: list[tuple[list, list]], count: int) -> None:
        self.large, self.groups, self.count = large, groups, count

    def run(self) -> None:
        """Launch every copy on the current stream."""
        for dst, src in self.large:
            dst.copy_(src)
        for dst, src in self.groups:
            torch._foreach_copy_(dst, src)

    def __len__(self) -> int:
        return self.count


def view_copies(copies: Copies, memory: Memory, itemsize: int) -> CopyViews:
    """View pairs for a program: large contiguous pairs alone; small contiguous pairs grouped by word type
    (so that they fuse into few launches); strided pairs in one more group."""
    per_word = word_elements(copies, itemsize).tolist()
    large: list[tuple] = []
    dense: dict[torch.dtype, tuple[list, list]] = {}
    strided: tuple[list, list] = ([], [])
    for (sk, si, so, sst, ssr, dk, di, do, dst_, dsr, n, r, c), w in zip(copies.rows_as_lists(), per_word):
        s, d = memory.get(sk, si, w), memory.get(dk, di, w)
        while s is None or d is None:  # a side's alignment does not allow words this wide: halve them
            w //= 2
            s, d = memory.get(sk, si, w), memory.get(dk, di, w)
        sv = copy_view(s, so // w, sst // w, ssr // w, n, r, c // w)
        dv = copy_view(d, do // w, dst_ // w, dsr // w, n, r, c // w)
        contiguous = sv.is_contiguous() and dv.is_contiguous()
        if contiguous and sv.numel() * sv.element_size() >= LARGE_BYTES:
            large.append((dv, sv))
            continue
        group = dense.setdefault(sv.dtype, ([], [])) if contiguous else strided
        group[0].append(dv)
        group[1].append(sv)
    groups = [g for g in (*dense.values(), strided) if g[0]]
    return CopyViews(large, groups, len(copies))
