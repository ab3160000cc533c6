"""Many contiguous copies as one Triton launch (executors.inprocess): thousands of separate copies each pay a launch
larger than their bytes' time (BENCHMARKS.md, Same host). Every copy is cut into chunks (KernelTuning's
copy_chunk_bytes), rows of one int64 table (table_plan.chunk_table) read by one program per chunk; addresses are
word offsets from one base tensor (so Triton's interpreter runs it too), one launch per word size.
"""
from __future__ import annotations

import numpy as np
import torch

import triton
import triton.language as tl

from .table_plan import chunk_table, chunk_words
from .tuning import KernelTuning


@triton.jit
def _copy_table_kernel(src_base, dst_base, table, rows, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    # one program per chunk (the grid is `rows`), written as the loop of the persistent grid it came from: indexing
    # by program id alone ran 12,000 copies 1-2% slower on an H100; 3 * rows fits 32 bits: the table is host-built
    for i in range(tl.program_id(0), rows, tl.num_programs(0)):
        s = tl.multiple_of(tl.load(table + 3 * i), ALIGN)
        d = tl.multiple_of(tl.load(table + 3 * i + 1), ALIGN)
        n = tl.multiple_of(tl.load(table + 3 * i + 2), ALIGN)
        for start in range(0, n, 2 * BLOCK):  # two blocks loaded before the first is stored: more bytes in flight
            offs = start + tl.arange(0, BLOCK)
            offs2 = offs + BLOCK
            x = tl.load(src_base + s + offs, mask=offs < n)
            y = tl.load(src_base + s + offs2, mask=offs2 < n)
            tl.store(dst_base + d + offs, x, mask=offs < n)
            tl.store(dst_base + d + offs2, y, mask=offs2 < n)


_ELEMENT = {16: torch.int64, 8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


class CopyTable:
    """Pairs (dst, src) of contiguous tensors of equal byte length on one device as prepared launches; `launch()`
    enqueues them (capturable in a CUDA graph). The tensors must stay in place. `tuning`: KernelTuning's `copy_*`.

    Raises:
        ValueError: a pair is not contiguous or of unequal byte length, or the tensors are on several devices."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], tuning: KernelTuning | None = None) -> None:
        tuning = tuning or KernelTuning()
        chunk_bytes, block_bytes = tuning.copy_chunk_bytes, tuning.copy_block_bytes
        self.num_warps = tuning.copy_warps
        if any(not (d.is_contiguous() and s.is_contiguous()) or d.nbytes != s.nbytes for d, s in pairs):
            raise ValueError("CopyTable: pairs must be contiguous and of equal byte length")
        devices = {t.device for pair in pairs for t in pair}
        if len(devices) > 1:
            raise ValueError("CopyTable: every tensor must be on one device")
        device = next(iter(devices), None)
        entries = [(s.data_ptr(), d.data_ptr(), d.nbytes) for d, s in pairs]
        self.count, self.bytes = len(entries), sum(e[2] for e in entries)
        self.launches: list[tuple] = []
        if not entries:
            return
        self._base = torch.empty(2, dtype=torch.int64, device=device)  # 16-byte aligned anchor of the offsets
        base = self._base.data_ptr()
        for word, rows in chunk_table(np.asarray(entries, dtype=np.int64), base, chunk_bytes).items():
            element = _ELEMENT[word]
            per = word // element.itemsize  # elements per word (2 int64 per 16-byte word)
            chunk = chunk_words(chunk_bytes, word) * per  # the most elements a chunk holds
            table = torch.from_numpy(np.ascontiguousarray(rows * per)).to(device)
            block = min(triton.next_power_of_2(max(1, block_bytes // element.itemsize)), triton.next_power_of_2(chunk))
            self.launches.append((self._base.view(element), table, len(rows), block, per))

    def launch(self) -> None:
        """Enqueue the copies on the current stream (asynchronous, like any kernel)."""
        for base, table, n, block, align in self.launches:
            _copy_table_kernel[(n,)](base, base, table, n, BLOCK=block, ALIGN=align, num_warps=self.num_warps)


__all__ = ["CopyTable"]
