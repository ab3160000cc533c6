"""The "sum64" checksum (executors.checksum) as a Triton kernel: each tile's three sums reduced in registers and
written as one partial, the partials added by one torch sum (int64, wrapping like the reference's).

For tile bytes x_c at positions p + c: s1 = sum x_c; s2 = (p + 1) s1 + sum c x_c; s3 = sum x_c T[(p + c) mod 2^23],
T computed in 32-bit arithmetic (exact in the low 31 bits). No sum overflows, so digests equal the reference's.
"""
from __future__ import annotations

import torch

import triton
import triton.language as tl

TILE = 2048


@triton.jit
def _sum64_kernel(x_ptr, out_ptr, row_bytes, row_stride, pos0, tiles_per_row, TILE: tl.constexpr):
    pid = tl.program_id(0)
    r = pid // tiles_per_row
    t = pid % tiles_per_row
    i = tl.arange(0, TILE)
    c = t * TILE + i
    inside = c < row_bytes
    x = tl.load(x_ptr + r.to(tl.int64) * row_stride + c, mask=inside, other=0).to(tl.int32)
    base = pos0 + r.to(tl.int64) * row_bytes + t * TILE  # the stream position of this tile's first byte
    s1 = tl.sum(x, axis=0).to(tl.int64)
    s2 = (base + 1) * s1 + tl.sum(x * i, axis=0).to(tl.int64)
    j = ((base % 8388608).to(tl.int32) + i) & 8388607
    weight = ((j * 1103515245 + 12345) & 0x7FFFFFFF) >> 8
    s3 = tl.sum((x * weight).to(tl.int64), axis=0)
    tl.store(out_ptr + pid * 3, s1)
    tl.store(out_ptr + pid * 3 + 1, s2)
    tl.store(out_ptr + pid * 3 + 2, s3)


def byte_rows(t: torch.Tensor) -> "tuple[torch.Tensor, int, int, int] | None":
    """A tensor's bytes as (uint8 base view, rows, bytes per row, row stride in bytes) when its elements are
    rows of contiguous bytes (1-D contiguous, or 2-D with unit inner stride); else None."""
    size = t.element_size()
    if t.dim() == 1 and t.stride(0) == 1 or t.dim() == 0:
        return t.reshape(-1).view(torch.uint8), 1, t.numel() * size, t.numel() * size
    if t.dim() == 2 and t.stride(1) == 1:
        rows, cols = t.shape
        # rows apart: read through the storage from the block's first element
        flat = t if rows == 1 or t.stride(0) == cols else torch.as_strided(t, (1,), (1,))
        return flat.view(torch.uint8), rows, cols * size, t.stride(0) * size
    return None


class Sum64Launches:
    """The kernel's launches over fixed blocks (a stream's blocks in order, starting at stream position 0):
    `launch()` writes every tile's partial sums into one buffer (capturable as a CUDA graph), `sums()` adds
    them (int64, on the device)."""

    def __init__(self, blocks: list[torch.Tensor], start: int = 0) -> None:
        self.launches, pos, programs = [], start, 0
        device = None
        for b in blocks:
            if not b.numel():
                continue
            rows = byte_rows(b)
            if rows is None:
                raise ValueError(f"sum64 kernel: block of shape {tuple(b.shape)} strides {b.stride()} is not rows of "
                                 f"contiguous bytes")
            base, n_rows, row_bytes, stride = rows
            tiles = -(-row_bytes // TILE)
            self.launches.append((base, programs, n_rows * tiles, row_bytes, stride, pos, tiles))
            pos += n_rows * row_bytes
            programs += n_rows * tiles
            device = b.device
        self.count = pos - start
        self.partials = torch.zeros((max(programs, 1), 3), dtype=torch.int64, device=device or "cpu")

    def launch(self) -> None:
        """Enqueue every tile's partial sums on the current stream (asynchronous, like any kernel)."""
        for base, first, n, row_bytes, stride, pos, tiles in self.launches:
            _sum64_kernel[(n,)](base, self.partials[first:], row_bytes, stride, pos, tiles, TILE=TILE, num_warps=4)

    def sums(self) -> torch.Tensor:
        """(s1, s2, s3) of the last launch, int64 on the device (wrapping mod 2^64)."""
        return self.partials.sum(dim=0)
