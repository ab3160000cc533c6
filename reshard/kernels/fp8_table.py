"""FP8 block quantization of many jobs in one Triton launch: a table of blocks on the device (kernels.fp8_blocks),
one program per block, each block quantized exactly as kernels.fp8_quantize does it (the same `_quantize_block`).

A refit's quantized weights arrive as hundreds of jobs, many of a few dozen blocks (one query group of a fused QKV
weight: 4 x 32 blocks). Launched one by one, each pays a launch and leaves the GPU part idle while its last wave
drains; here the launch cost is paid once per input dtype and alignment. Addresses enter as element offsets from
one base tensor (`base + offset`: no integer to pointer casts, so Triton's interpreter runs it too).
"""
from __future__ import annotations

import numpy as np
import torch

import triton
import triton.language as tl

from . import fp8_blocks
from .fp8_quantize import AMAX_FLOOR, AMAX_MODES, FP8_MAX, TUNING, _quantize_block, check_job, interpreted

VECTOR_BYTES = 16  # the widest load and store a thread issues


@triton.jit
def _quantize_table_kernel(x_base, q_base, s_base, table, BN: tl.constexpr, BK: tl.constexpr,
                           FLOOR: tl.constexpr, FMAX: tl.constexpr, EXACT_CAST: tl.constexpr, AMAX: tl.constexpr,
                           XALIGN: tl.constexpr, QALIGN: tl.constexpr):
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
    bits, scale = _quantize_block(xb, FLOOR, FMAX, EXACT_CAST, AMAX)
    tl.store(q_base + qo + r * sq + c, bits, mask=inside)
    tl.store(s_base + so, scale)


class QuantizeTable:
    """The jobs (x, q, s) -- x a 2-D bf16, float16 or float32 view with contiguous rows, q its float8_e4m3fn view
    of the same shape with contiguous rows, s its float32 block scales [ceil(n/bn), ceil(k/bk)] (any strides), all
    on one device -- as prepared launches, one per input dtype and alignment; `launch()` enqueues them on the current
    stream (capturable in a CUDA graph). Tuning (warps, amax) is fp8_quantize.TUNING's when built. The tensors must
    stay in place (the caller pins them)."""

    def __init__(self, jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], block: tuple[int, int],
                 num_warps: int | None = None, exact_cast: bool | None = None) -> None:
        self.block = (int(block[0]), int(block[1]))
        self.num_warps = int(num_warps or TUNING["num_warps"])
        self.amax = AMAX_MODES[TUNING["amax"]]
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
        check_job(*job, self.block, "QuantizeTable")
        if any(t.device != device for t in job):
            raise ValueError("QuantizeTable: every tensor must be on one device")

    def launch(self) -> None:
        for anchor_x, rows, count, x_align, q_align in self.launches:
            _quantize_table_kernel[(count,)](anchor_x, self._anchor.view(torch.uint8), self._anchor.view(torch.float32),
                                             rows, BN=self.block[0], BK=self.block[1], FLOOR=AMAX_FLOOR,
                                             FMAX=FP8_MAX, EXACT_CAST=self.exact, AMAX=self.amax, XALIGN=x_align,
                                             QALIGN=q_align, num_warps=self.num_warps)
