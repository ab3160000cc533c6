"""FP8 block quantization of many jobs in one Triton launch: one program per block of a table of every job's
blocks (kernels.fp8_blocks), one launch per input dtype and alignment (per-job launches measured slower:
BENCHMARKS.md, FP8). Addresses are element offsets from one base tensor, so Triton's interpreter runs it too.

Numerics equal the reference's (executors.fp8.quantize_blocks) byte for byte: amax = max |x| in float32, raised to
1e-4; scale = amax / 448 and inv = 1 / scale by correctly rounded division (`div_rn`); q = fp8(float32(x) * inv),
round to nearest even. A NaN in a block makes its amax, scale and values NaN (amax is reduced over integer keys that
order NaN above inf); an inf makes inv 0 (finite values become signed zeros, the inf NaN); an fp8 NaN is 0x7F with
the product's sign, as torch's cast writes it. Denormals are not flushed.
"""
from __future__ import annotations

import os

import numpy as np
import torch

import triton
import triton.language as tl

from ..layouts.fp8 import AMAX_FLOOR, FP8_MAX
from . import fp8_blocks
from .tuning import KernelTuning

VECTOR_BYTES = 16  # the widest load and store a thread issues


@triton.jit
def _fp8_bits(y):
    """float8_e4m3fn bits of float32 `y` exactly as torch's cast makes them, in integer arithmetic (Triton's
    interpreter misrounds its own fp8 conversion at exponent boundaries)."""
    b = y.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    f = b & 0x7FFFFFFF
    sub = ((f.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - 0x46800000) & 0xFF
    odd = (f >> 20) & 1
    norm = ((f - 0x3C000000 + 0x7FFFF + odd) >> 20) & 0xFF
    r = tl.where(f >= 0x43F00000, 0x7F, tl.where(f < 0x3C800000, sub, norm))
    return (r | sign).to(tl.uint8)


@triton.jit
def _fp8_of(y, EXACT_CAST: tl.constexpr):
    """fp8 bits of float32 `y`, torch's cast."""
    if EXACT_CAST:
        return _fp8_bits(y)
    # the hardware's saturating cast equals torch's for every finite y here (|y| <= 448); inf / NaN -> signed NaN
    bits = y.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    ybits = y.to(tl.uint32, bitcast=True)
    bad = (ybits & 0x7FFFFFFF) >= 0x7F800000
    return tl.where(bad, ((ybits >> 24) & 0x80).to(tl.uint8) | 0x7F, bits)


@triton.jit
def _block_amax(xb, FLOOR: tl.constexpr):
    """The float32 amax of block `xb` (raised to FLOOR; NaN stays NaN), reduced over |x|'s bit pattern (a 16-bit
    input's own bits: half the registers; BENCHMARKS.md, FP8)."""
    if xb.dtype.primitive_bitwidth == 16:
        m = tl.max(tl.max(xb.to(tl.int16, bitcast=True).to(tl.int32) & 0x7FFF, axis=1), axis=0)
        amax = m.to(tl.int16).to(xb.dtype, bitcast=True).to(tl.float32)  # float32 holds every 16-bit value exactly
    else:
        m = tl.max(tl.max(xb.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1), axis=0)
        amax = tl.where(m > 0x7F800000, float("nan"), m.to(tl.float32, bitcast=True))
    return tl.where(amax < FLOOR, FLOOR, amax)


@triton.jit
def _quantize_block(xb, FLOOR: tl.constexpr, FMAX: tl.constexpr, EXACT_CAST: tl.constexpr):
    """(fp8 bits, scale) of one block `xb` (masked-off elements loaded as zeros)."""
    amax = _block_amax(xb, FLOOR)
    x = xb.to(tl.float32)
    scale = tl.math.div_rn(amax, FMAX)
    inv = tl.math.div_rn(1.0, scale)
    return _fp8_of(x * inv, EXACT_CAST), scale


@triton.jit
def _quantize_table_kernel(x_base, q_base, s_base, table, BN: tl.constexpr, BK: tl.constexpr,
                           FLOOR: tl.constexpr, FMAX: tl.constexpr, EXACT_CAST: tl.constexpr, XALIGN: tl.constexpr,
                           QALIGN: tl.constexpr):
    """One program per block: row `program_id` of the block table (kernels.fp8_blocks.FIELDS)."""
    row = table + 7 * tl.program_id(0).to(tl.int64)  # fp8_blocks.FIELDS
    xo = tl.multiple_of(tl.load(row), XALIGN)
    qo = tl.multiple_of(tl.load(row + 1), QALIGN)
    so = tl.load(row + 2)
    sx = tl.multiple_of(tl.load(row + 3), XALIGN)
    sq = tl.multiple_of(tl.load(row + 4), QALIGN)
    nr = tl.load(row + 5)
    nc = tl.multiple_of(tl.load(row + 6), QALIGN)  # aligned launches hold whole vectors: the mask is per vector
    r = tl.arange(0, BN).to(tl.int64)[:, None]
    c = tl.arange(0, BK)[None, :]
    inside = (r < nr) & (c < nc)
    xb = tl.load(x_base + xo + r * sx + c, mask=inside, other=0.0)
    bits, scale = _quantize_block(xb, FLOOR, FMAX, EXACT_CAST)
    tl.store(q_base + qo + r * sq + c, bits, mask=inside)
    tl.store(s_base + so, scale)


class QuantizeTable:
    """Quantization jobs as prepared launches; `launch()` enqueues them on the current stream (capturable in a
    CUDA graph). The tensors must stay in place (the caller pins them).

    Args:
        jobs: (x, q, s) per job: x a 2-D bf16 / float16 / float32 view with contiguous rows, q its float8_e4m3fn
            view of the same shape, s its float32 block scales [ceil(n/bn), ceil(k/bk)], all on one device.
        block: the quantization block (rows, columns).
        tuning: warps per program (KernelTuning.quantize_warps; default KernelTuning()).
        exact_cast: the integer fp8 cast instead of the hardware's (default: under Triton's interpreter only,
            whose own cast misrounds).

    Raises:
        ValueError: a job's shapes, dtypes, strides or devices are not as above."""

    def __init__(self, jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], block: tuple[int, int],
                 tuning: KernelTuning | None = None, exact_cast: bool | None = None) -> None:
        self.block = (int(block[0]), int(block[1]))
        self.num_warps = (tuning or KernelTuning()).quantize_warps
        interpreter = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # Triton's (TRITON_INTERPRET set)
        self.exact = interpreter if exact_cast is None else bool(exact_cast)
        self.launches: list[tuple] = []
        self.blocks = 0
        if not jobs:
            return
        device = jobs[0][0].device
        self._anchor = torch.empty(2, dtype=torch.int64, device=device)  # 16-byte aligned base of every offset
        groups: dict[tuple, list] = {}
        for job in jobs:
            self._check(job, device)
            x, q, s = job
            meta = (self._offset(x), self._offset(q), self._offset(s), x.shape[0], x.shape[1], x.stride(0),
                    q.stride(0), s.stride(0), s.stride(1))
            aligns = (VECTOR_BYTES // x.element_size(), VECTOR_BYTES)
            wide = fp8_blocks.aligned(meta, self.block, *aligns)
            groups.setdefault((x.dtype, *(aligns if wide else (1, 1))), []).append(meta)
        for (dtype, x_align, q_align), metas in groups.items():
            rows = fp8_blocks.table(metas, self.block)
            if not len(rows):
                continue
            self.launches.append((self._anchor.view(dtype), torch.from_numpy(np.ascontiguousarray(rows)).to(device),
                                  len(rows), x_align, q_align))
            self.blocks += len(rows)

    def _offset(self, t: torch.Tensor) -> int:
        delta = t.data_ptr() - self._anchor.data_ptr()
        if delta % t.element_size():
            raise ValueError(f"QuantizeTable: a {t.dtype} view at {t.data_ptr():#x} is not aligned to its elements")
        return delta // t.element_size()

    def _check(self, job: tuple, device: torch.device) -> None:
        x, q, s = job
        n, k = x.shape if x.dim() == 2 else (0, 0)
        nb, kb = -(-n // self.block[0]), -(-k // self.block[1])
        if x.dim() != 2 or tuple(q.shape) != (n, k) or tuple(s.shape) != (nb, kb):
            raise ValueError(f"QuantizeTable: x {tuple(x.shape)}, q {tuple(q.shape)}, s {tuple(s.shape)} do not "
                             f"match blocks {self.block}")
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or q.dtype != torch.float8_e4m3fn or \
                s.dtype != torch.float32:
            raise ValueError(f"QuantizeTable: x {x.dtype}, q {q.dtype}, s {s.dtype}: needs bf16 / float16 / float32 "
                             "in, float8_e4m3fn and float32 out")
        if x.stride(-1) != 1 or q.stride(-1) != 1:
            raise ValueError("QuantizeTable needs rows contiguous in x and q")
        if any(t.device != device for t in job):
            raise ValueError("QuantizeTable: every tensor must be on one device")

    def launch(self) -> None:
        """Enqueue the launches on the current stream (asynchronous, like any kernel)."""
        for anchor_x, rows, count, x_align, q_align in self.launches:
            _quantize_table_kernel[(count,)](anchor_x, self._anchor.view(torch.uint8), self._anchor.view(torch.float32),
                                             rows, BN=self.block[0], BK=self.block[1], FLOOR=AMAX_FLOOR,
                                             FMAX=FP8_MAX, EXACT_CAST=self.exact, XALIGN=x_align,
                                             QALIGN=q_align, num_warps=self.num_warps)


__all__ = ["AMAX_FLOOR", "FP8_MAX", "QuantizeTable"]
