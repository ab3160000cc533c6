"""FP8 block quantization as one Triton kernel: each bf16 block read once, its fp8 values and its scale written
once, straight where they belong (a destination's fp8 weight and `weight_scale_inv`, or a sender's shadows).

Numerics are the reference's (executors.fp8.quantize_blocks), operation for operation, so the bytes are equal:
amax = max |x| over the block in float32 (zeros padding a partial block never raise it), raised to 1e-4;
scale = amax / 448 and inv = 1 / scale, both correctly rounded float32 divisions (`div_rn`: Triton's plain `/`
is an approximate division); q = float8_e4m3fn(float32(x) * inv), round to nearest even.
Non-finite values, the reference's policy kept:
- a NaN anywhere in a block makes the block's amax, scale and every fp8 value NaN (torch's amax propagates NaN;
  Triton's max would drop it, so the kernel flags it);
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

import torch

import triton
import triton.language as tl

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
# how a block's amax is reduced: over the input's own 16-bit patterns (float32 inputs: as "float32 bits"), over
# float32 bit patterns, or over float32 values with a NaN flag; all give the same bytes
AMAX_MODES = {"input bits": 2, "float32 bits": 1, "float": 0}
# launch settings (benchmarks/refit_inprocess.py --quantize-variants compares them; benchmarks/quantizer_occupancy.py
# shows what each allows per SM): `strip` blocks of a block row per program (0: one program per block), `prefetch`
# the next block of a strip loaded before this one is stored, `amax` a key of AMAX_MODES, `table` the executors'
# jobs all in one launch (kernels.fp8_table: one program per block, strip does not apply). The defaults are the
# fastest of the sweep on an H200 (BENCHMARKS.md, FP8, issue 31 sixth round), each checked there byte for byte
TUNING = {"num_warps": 8, "amax": "input bits", "strip": 0, "prefetch": True, "table": True}


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
def _amax_key(xb, AMAX: tl.constexpr):
    """max over block (or part of a block) `xb` of an integer that orders like |x| and puts a NaN above inf:
    |x|'s bit pattern, of the 16-bit input itself (AMAX 2: only the packed 16-bit values stay live, not their
    float32 forms, which would hold 3-4 registers per element) or of its float32 form. Keys of parts of one block
    combine with max."""
    if AMAX == 2 and xb.dtype.primitive_bitwidth == 16:
        return tl.max(tl.max(xb.to(tl.int16, bitcast=True).to(tl.int32) & 0x7FFF, axis=1), axis=0)
    return tl.max(tl.max(xb.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1), axis=0)


@triton.jit
def _amax_of_key(m, xb, FLOOR: tl.constexpr, AMAX: tl.constexpr):
    """The block's float32 amax (raised to FLOOR; a NaN stays NaN) from its `_amax_key` (`xb`: for its dtype)."""
    if AMAX == 2 and xb.dtype.primitive_bitwidth == 16:  # float32 holds every 16-bit value exactly
        amax = m.to(tl.int16).to(xb.dtype, bitcast=True).to(tl.float32)
    else:
        amax = tl.where(m > 0x7F800000, float("nan"), m.to(tl.float32, bitcast=True))
    return tl.where(amax < FLOOR, FLOOR, amax)


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
def _quantize_block(xb, FLOOR: tl.constexpr, FMAX: tl.constexpr, EXACT_CAST: tl.constexpr,
                    AMAX: tl.constexpr):
    """(fp8 bits, scale) of one block `xb` (masked-off elements loaded as zeros)."""
    if AMAX >= 1:
        amax = _amax_of_key(_amax_key(xb, AMAX), xb, FLOOR, AMAX)
        x = xb.to(tl.float32)
    else:
        x = xb.to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        nan = tl.max(tl.max((x != x).to(tl.int32), axis=1), axis=0)
        amax = tl.where(amax < FLOOR, FLOOR, amax)
        amax = tl.where(nan > 0, float("nan"), amax)
    scale = tl.math.div_rn(amax, FMAX)
    inv = tl.math.div_rn(1.0, scale)
    return _fp8_of(x * inv, EXACT_CAST), scale


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, n, k, sx, sq, ss0, ss1,
                     BN: tl.constexpr, BK: tl.constexpr, FLOOR: tl.constexpr, FMAX: tl.constexpr,
                     EXACT_CAST: tl.constexpr, AMAX: tl.constexpr):
    """One program per block."""
    bi = tl.program_id(0)
    bj = tl.program_id(1)
    rows = bi * BN + tl.arange(0, BN)
    cols = bj * BK + tl.arange(0, BK)
    inside = (rows[:, None] < n) & (cols[None, :] < k)
    r64 = rows.to(tl.int64)[:, None]
    xb = tl.load(x_ptr + r64 * sx + cols[None, :], mask=inside, other=0.0)
    bits, scale = _quantize_block(xb, FLOOR, FMAX, EXACT_CAST, AMAX)
    tl.store(q_ptr + r64 * sq + cols[None, :], bits, mask=inside)
    tl.store(s_ptr + bi * ss0 + bj * ss1, scale)


@triton.jit
def _quantize_strip_kernel(x_ptr, q_ptr, s_ptr, n, k, kb, per, sx, sq, ss0, ss1,
                           BN: tl.constexpr, BK: tl.constexpr, FLOOR: tl.constexpr, FMAX: tl.constexpr,
                           EXACT_CAST: tl.constexpr, AMAX: tl.constexpr, PREFETCH: tl.constexpr):
    """One program per strip of `per` blocks along a block row; neighbouring programs take neighbouring strips.
    PREFETCH: the strip's next block is loaded before this one is reduced and stored, so that a program keeps
    loads in flight while it computes (the one-block kernel's loads stop while it reduces)."""
    g = tl.program_id(0)
    bi = tl.program_id(1)
    rows = bi * BN + tl.arange(0, BN)
    r64 = rows.to(tl.int64)[:, None]
    live = (rows < n)[:, None]
    offs = tl.arange(0, BK)[None, :]
    x_rows = x_ptr + r64 * sx
    q_rows = q_ptr + r64 * sq
    first = g * per
    last = tl.minimum(first + per, kb)
    limit = tl.minimum(last * BK, k)  # this strip's columns end here
    cols = first * BK + offs
    xb = tl.load(x_rows + cols, mask=live & (cols < limit), other=0.0)
    for bj in range(first, last):
        if PREFETCH:
            following = cols + BK
            ahead = tl.load(x_rows + following, mask=live & (following < limit), other=0.0)
        bits, scale = _quantize_block(xb, FLOOR, FMAX, EXACT_CAST, AMAX)
        tl.store(q_rows + cols, bits, mask=live & (cols < limit))
        tl.store(s_ptr + bi * ss0 + bj * ss1, scale)
        cols += BK
        if PREFETCH:
            xb = ahead
        else:
            xb = tl.load(x_rows + cols, mask=live & (cols < limit), other=0.0)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_job(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: tuple[int, int], who: str) -> None:
    """What the kernels take (ValueError naming `who` otherwise): x a 2-D bf16, float16 or float32 view, q its
    float8_e4m3fn view of the same shape, rows of both contiguous, s float32 [ceil(n/bn), ceil(k/bk)]."""
    n, k = x.shape if x.dim() == 2 else (0, 0)
    nb, kb = -(-n // block[0]), -(-k // block[1])
    if x.dim() != 2 or tuple(q.shape) != (n, k) or tuple(s.shape) != (nb, kb):
        raise ValueError(f"{who}: x {tuple(x.shape)}, q {tuple(q.shape)}, s {tuple(s.shape)} do not match blocks "
                         f"{tuple(block)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or q.dtype != torch.float8_e4m3fn or \
            s.dtype != torch.float32:
        raise ValueError(f"{who}: x {x.dtype}, q {q.dtype}, s {s.dtype}: needs bf16 / float16 / float32 in, "
                         "float8_e4m3fn and float32 out")
    if x.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError(f"{who} needs rows contiguous in x and q")


def quantize_into(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: tuple[int, int],
                  num_warps: int | None = None, exact_cast: bool | None = None) -> None:
    """Quantize the 2-D bf16 (or float16 / float32) view `x` into the float8_e4m3fn view `q` (same shape) and its
    float32 block scales into `s` ([ceil(n/bn), ceil(k/bk)]). Rows of `x` and `q` must be contiguous (any row
    stride); `s` any strides. One launch; asynchronous like any kernel. `exact_cast`: the integer cast instead
    of the hardware's (default: under the interpreter only)."""
    check_job(x, q, s, block, "quantize_into")
    n, k = x.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    if n == 0 or k == 0:
        return
    exact = interpreted() if exact_cast is None else bool(exact_cast)
    warps = num_warps or TUNING["num_warps"]
    amax = AMAX_MODES[TUNING["amax"]]
    per = min(int(TUNING["strip"]), kb)
    if per <= 0:
        _quantize_kernel[(nb, kb)](x, q.view(torch.uint8), s, n, k, x.stride(0), q.stride(0), s.stride(0),
                                   s.stride(1), BN=bn, BK=bk, FLOOR=AMAX_FLOOR, FMAX=FP8_MAX, EXACT_CAST=exact,
                                   AMAX=amax, num_warps=warps)
        return
    _quantize_strip_kernel[(-(-kb // per), nb)](x, q.view(torch.uint8), s, n, k, kb, per, x.stride(0), q.stride(0),
                                                s.stride(0), s.stride(1), BN=bn, BK=bk, FLOOR=AMAX_FLOOR,
                                                FMAX=FP8_MAX, EXACT_CAST=exact, AMAX=amax,
                                                PREFETCH=bool(TUNING["prefetch"]), num_warps=warps)
