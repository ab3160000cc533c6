"""FP8 block quantization of many jobs in one Triton launch: each bf16 block read once, its fp8 values and its
scale written once, straight where they belong (a destination's fp8 weight and `weight_scale_inv`, or a sender's
shadows).

A refit's quantized weights arrive as hundreds of jobs, many of a few dozen blocks (one query group of a fused QKV
weight: 4 x 32 blocks). Launched one by one, each pays a launch and leaves the GPU part idle while its last wave
drains; here a table of every job's blocks (kernels.fp8_blocks) is read by one program per block, one launch per
input dtype and alignment (a launch per job, and strips of blocks per program, measured slower: BENCHMARKS.md, FP8,
issue 31 sixth round). Addresses enter as element offsets from one base tensor (`base + offset`: no integer to
pointer casts, so Triton's interpreter runs it too).

Numerics are the reference's (executors.fp8.quantize_blocks), operation for operation, so the bytes are equal:
amax = max |x| over the block in float32 (zeros padding a partial block never raise it), raised to 1e-4;
scale = amax / 448 and inv = 1 / scale, both correctly rounded float32 divisions (`div_rn`: Triton's plain `/`
is an approximate division); q = float8_e4m3fn(float32(x) * inv), round to nearest even.
Non-finite values, the reference's policy kept:
- a NaN anywhere in a block makes the block's amax, scale and every fp8 value NaN (torch's amax propagates NaN;
  Triton's float max would drop it, so the kernel reduces integer keys that order a NaN above inf);
- an infinity makes amax and scale inf and inv 0: the block's finite values become (signed) zeros and the
  infinity itself NaN (inf * 0);
- an fp8 NaN is 0x7F with the product's sign bit (torch's cast; the hardware's saturating cast would give 448
  instead, so the kernel writes those bytes itself). The sign of a NaN produced by arithmetic is the device's
  (a GPU's is canonical, positive; an x86 CPU's default NaN is negative), the same for kernel and reference on
  one device.
Denormal inputs and outputs round like any value (no flush to zero on either path).
"""
from __future__ import annotations

import os

import numpy as np
import torch

import triton
import triton.language as tl

from . import fp8_blocks
from .tuning import KernelTuning

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
VECTOR_BYTES = 16  # the widest load and store a thread issues


@triton.jit
def _fp8_bits(y):
    """float8_e4m3fn bits of float32 `y` exactly as torch's cast makes them (c10's fp8e4m3fn_from_fp32_value:
    round to nearest even, denormals through a float add, |y| >= 464 and non-finite to NaN 0x7F, sign kept), in
    integer arithmetic: for Triton's interpreter, whose own fp8 conversion misrounds at exponent boundaries."""
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
    # the hardware's cast (round to nearest even, saturating): the same bytes for |y| < 464, which is every finite
    # y here (|y| <= amax * inv ~ 448); inf and NaN become torch's NaN with the sign
    bits = y.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    ybits = y.to(tl.uint32, bitcast=True)
    bad = (ybits & 0x7FFFFFFF) >= 0x7F800000
    return tl.where(bad, ((ybits >> 24) & 0x80).to(tl.uint8) | 0x7F, bits)


@triton.jit
def _block_amax(xb, FLOOR: tl.constexpr):
    """The float32 amax of block `xb` (raised to FLOOR; a NaN stays NaN), reduced over an integer that orders like
    |x| and puts a NaN above inf: |x|'s bit pattern, of a 16-bit input itself (only the packed 16-bit values stay
    live, not their float32 forms: half the registers, twice the programs an SM; BENCHMARKS.md, FP8) or of a
    float32 input."""
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


def interpreted() -> bool:
    """Whether Triton runs kernels through its interpreter (TRITON_INTERPRET set): then the integer fp8 cast."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class QuantizeTable:
    """The jobs (x, q, s) -- x a 2-D bf16, float16 or float32 view with contiguous rows, q its float8_e4m3fn view
    of the same shape with contiguous rows, s its float32 block scales [ceil(n/bn), ceil(k/bk)] (any strides), all
    on one device -- as prepared launches, one per input dtype and alignment; `launch()` enqueues them on the current
    stream (capturable in a CUDA graph). The tensors must stay in place (the caller pins them).

    Args:
        jobs: (x, q, s) per job.
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
        self.exact = interpreted() if exact_cast is None else bool(exact_cast)
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


__all__ = ["AMAX_FLOOR", "FP8_MAX", "QuantizeTable", "interpreted"]
