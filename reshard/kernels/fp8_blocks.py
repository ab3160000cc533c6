"""The block table of kernels.fp8_quantize in plain numpy (property-tested on any machine): one row per
quantization block of every job, (x offset, q offset, s offset, x row stride, q row stride, rows, columns) in
elements, rows and columns clipped at a job's edges."""
from __future__ import annotations

import numpy as np

FIELDS = ("x", "q", "s", "sx", "sq", "rows", "cols")


def block_rows(job: tuple[int, ...], block: tuple[int, int]) -> np.ndarray:
    """int64 [blocks, len(FIELDS)]: the blocks of one job (x, q, s, n, k, sx, sq, ss0, ss1: offsets and strides in
    elements), row-major (neighbouring rows of the table read neighbouring memory)."""
    x, q, s, n, k, sx, sq, ss0, ss1 = (int(v) for v in job)
    bn, bk = (int(b) for b in block)
    if bn < 1 or bk < 1:
        raise ValueError(f"block_rows: block {block} must be positive")
    if n < 0 or k < 0:
        raise ValueError(f"block_rows: job of shape [{n}, {k}]")
    nb, kb = -(-n // bn), -(-k // bk)
    bi = np.repeat(np.arange(nb, dtype=np.int64), kb)
    bj = np.tile(np.arange(kb, dtype=np.int64), nb)
    fields = [x + bi * bn * sx + bj * bk, q + bi * bn * sq + bj * bk, s + bi * ss0 + bj * ss1, sx, sq,
              np.minimum(bn, n - bi * bn), np.minimum(bk, k - bj * bk)]  # FIELDS' order
    return np.stack(np.broadcast_arrays(*fields), axis=1).astype(np.int64)


def aligned(job: tuple[int, ...], block: tuple[int, int], x_align: int, q_align: int) -> bool:
    """Whether every block of `job` starts, steps rows and ends its columns on multiples of x_align (x elements)
    and q_align (q elements): then the kernel may read and write the block in wide vectors."""
    x, q, _, _, k, sx, sq, _, _ = (int(v) for v in job)
    bk = int(block[1])
    return (x % x_align == 0 and sx % x_align == 0 and bk % x_align == 0 and k % x_align == 0
            and q % q_align == 0 and sq % q_align == 0 and bk % q_align == 0 and k % q_align == 0)


def table(jobs: list[tuple[int, ...]], block: tuple[int, int]) -> np.ndarray:
    """The rows of all `jobs`, job after job."""
    parts = [block_rows(j, block) for j in jobs]
    return np.concatenate(parts) if parts else np.empty((0, len(FIELDS)), dtype=np.int64)

