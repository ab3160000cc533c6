"""Copies and their "sum64" checksum (executors.checksum) in one Triton launch, each byte read once (a separate
checksum pass cost 1.7x the refit on an H200: BENCHMARKS.md, issue 31).

The checksum weights T[j] repeat with period 2^23, so the stream is folded: one program per window of a period's
columns walks every piece of the stream in that window (kernels.table_plan.window_table), copies it and sums its
bytes per column Y[j] over all periods; then it weighs each column once: s1 = sum Y, s2 = sum (j + 1) Y +
2^23 sum_p p S_p (S_p: the window's bytes of period p), s3 = sum T[j] Y. Bytes are added as 16-bit lanes, spilled
every FLUSH rows before a lane can overflow; every sum is exact, so the digest equals the reference's bit for bit.
Pieces aligned to 16 bytes move as int32 vectors, to 4 as int32 words, others byte by byte (one launch each).
"""
from __future__ import annotations

import struct

import numpy as np
import torch

import triton
import triton.language as tl

from .table_plan import window_table
from .tuning import KernelTuning

PERIOD = 1 << 23  # the weights' period (executors.checksum.PERIOD)
FLUSH = 256  # rows between spills of the 16-bit lanes: 256 x 255 < 2^16
_MASK64 = (1 << 64) - 1


@triton.jit
def _copy_sum64_kernel(base, table, starts, out, period, WINDOW: tl.constexpr, WORD: tl.constexpr,
                       ALIGN: tl.constexpr, FLUSH: tl.constexpr):
    g = tl.program_id(0)
    lo = tl.load(starts + g)
    hi = tl.load(starts + g + 1)
    V: tl.constexpr = 4
    cols = tl.arange(0, WINDOW // V)[:, None] * V + tl.arange(0, V)[None, :]  # word columns of the window
    y0 = tl.zeros((WINDOW // V, V), dtype=tl.int32)
    y1 = tl.zeros((WINDOW // V, V), dtype=tl.int32)
    y2 = tl.zeros((WINDOW // V, V), dtype=tl.int32)
    y3 = tl.zeros((WINDOW // V, V), dtype=tl.int32)
    by_period = tl.zeros((WINDOW // V,), dtype=tl.int64)  # sum over rows of period x the row's bytes
    s, d, n, c0, p = _row(table + 5 * lo, ALIGN)  # each row's fields are loaded one iteration ahead
    for first in range(lo, hi, FLUSH):
        even = tl.zeros((WINDOW // V, V), dtype=tl.int32)  # bytes 0 and 2 of each word, 16-bit lanes
        odd = tl.zeros((WINDOW // V, V), dtype=tl.int32)  # bytes 1 and 3
        for i in range(first, tl.minimum(first + FLUSH, hi)):
            s_next, d_next, n_next, c0_next, p_next = _row(table + 5 * (i + 1), ALIGN)  # past the end: a zero row
            inside = (cols >= c0) & (cols < c0 + n)
            x = tl.load(base + (s - c0) + cols, mask=inside, other=0)
            tl.store(base + (d - c0) + cols, x, mask=inside)
            if WORD == 4:
                e = x & 0x00FF00FF
                o = (x >> 8) & 0x00FF00FF
                even += e
                odd += o
                t = tl.sum(e + o, axis=1)  # 16-bit lanes, each <= 4 x 510
                by_period += p * ((t & 0xFFFF) + ((t >> 16) & 0xFFFF)).to(tl.int64)
            else:
                b = x.to(tl.int32)
                y0 += b
                by_period += p * tl.sum(b, axis=1).to(tl.int64)
            s, d, n, c0, p = s_next, d_next, n_next, c0_next, p_next
        if WORD == 4:
            y0 += even & 0xFFFF
            y2 += (even >> 16) & 0xFFFF
            y1 += odd & 0xFFFF
            y3 += (odd >> 16) & 0xFFFF
    j = g * (WINDOW * WORD) + cols * WORD  # the period offset of each word's first byte (< period < 2^31)
    s1, s2, s3 = _weigh(y0, j)
    if WORD == 4:
        a1, a2, a3 = _weigh(y1, j + 1)
        b1, b2, b3 = _weigh(y2, j + 2)
        c1, c2, c3 = _weigh(y3, j + 3)
        s1 += a1 + b1 + c1
        s2 += a2 + b2 + c2
        s3 += a3 + b3 + c3
    tl.store(out + g * 3, s1)
    tl.store(out + g * 3 + 1, s2 + period * tl.sum(by_period, axis=0))
    tl.store(out + g * 3 + 2, s3)


@triton.jit
def _row(row, ALIGN: tl.constexpr):
    """A table row: source and destination offsets, length, column offset (words), period."""
    return (tl.multiple_of(tl.load(row), ALIGN), tl.multiple_of(tl.load(row + 1), ALIGN),
            tl.multiple_of(tl.load(row + 2), ALIGN), tl.multiple_of(tl.load(row + 3), ALIGN), tl.load(row + 4))


@triton.jit
def _weigh(y, j):
    """The window's sums for the byte columns y at period offsets j: sum y, sum (j + 1) y, sum T[j] y (int64)."""
    y = y.to(tl.int64)
    weight = ((j * 1103515245 + 12345) & 0x7FFFFFFF) >> 8
    return (tl.sum(tl.sum(y, axis=1), axis=0), tl.sum(tl.sum((j + 1).to(tl.int64) * y, axis=1), axis=0),
            tl.sum(tl.sum(weight.to(tl.int64) * y, axis=1), axis=0))


_VIEW = {16: torch.int32, 4: torch.int32, 1: torch.uint8}


class CopySum64:
    """Copies (src address, dst address, nbytes, stream position) on one device as prepared launches, and the
    "sum64" digest of the `count` stream bytes they read: `launch()` enqueues them (capturable in a CUDA graph),
    `digest()` returns executors.checksum's digest. The memory must stay in place (the caller pins it).
    `tuning`: KernelTuning's `sum64_*`; `period` and `flush` are lowered only by tests.

    Raises:
        ValueError: `flush` outside [1, FLUSH]."""

    def __init__(self, entries: np.ndarray, device: torch.device, count: int, tuning: KernelTuning | None = None,
                 period: int = PERIOD, flush: int = FLUSH) -> None:
        if not 1 <= int(flush) <= FLUSH:  # more rows could overflow a 16-bit lane
            raise ValueError(f"CopySum64: flush must be 1 to {FLUSH}, not {flush}")
        tuning = tuning or KernelTuning()
        window = tuning.sum64_window_bytes
        self.num_warps, self.flush = tuning.sum64_warps, int(flush)
        self.count, self.period = int(count), int(period)
        self._base = torch.empty(4, dtype=torch.int32, device=device)  # 16-byte aligned anchor of the offsets
        self.launches: list[tuple] = []
        programs = 0
        for word, (rows, starts) in window_table(entries, self._base.data_ptr(), window, self.period).items():
            view = self._base.view(_VIEW[word])
            per = view.element_size()
            rows = np.concatenate([rows, np.zeros((1, 5), dtype=np.int64)])  # read ahead past the last row
            rows[:, :4] *= word // per  # in the view's elements (16-byte words are 4 int32 each)
            self.launches.append((view, torch.from_numpy(rows).to(device),
                                  torch.from_numpy(starts).to(device), programs, len(starts) - 1,
                                  window // per, per, word // per))
            programs += len(starts) - 1
        self.partials = torch.zeros((max(programs, 1), 3), dtype=torch.int64, device=device)

    def launch(self) -> None:
        """Enqueue the copies and their partial sums on the current stream (asynchronous, like any kernel)."""
        for base, table, starts, first, n, window, word, align in self.launches:
            _copy_sum64_kernel[(n,)](base, table, starts, self.partials[first:], self.period, WINDOW=window,
                                     WORD=word, ALIGN=align, FLUSH=self.flush, num_warps=self.num_warps)

    def sums(self) -> torch.Tensor:
        """(s1, s2, s3) of the last launch, int64 on the device (wrapping mod 2^64)."""
        return self.partials.sum(dim=0)

    def digest(self) -> bytes:
        """The stream's "sum64" digest (executors.checksum's bytes: count, s1, s2, s3); waits for the launch."""
        sums = [int(v) & _MASK64 for v in self.sums().tolist()]
        return struct.pack("<4Q", self.count & _MASK64, *sums)


__all__ = ["CopySum64", "FLUSH", "PERIOD"]
