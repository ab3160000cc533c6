"""An FP8 block checkpoint made the slow, obvious way: the ground truth quantizing refits are tested against.

Written apart from `reshard.executors.fp8` on purpose (block by block, in Python loops, on whole canonical
tensors). The formula follows DeepGEMM's `per_block_cast_to_fp8` as vendored in vLLM
(`vllm/third_party/deep_gemm/utils/math.py`, `vllm/utils/deep_gemm.py`), which is how DeepSeek-V3's FP8 release
defines its `weight_scale_inv`: per block, amax = max |x| in float32 clamped to at least 1e-4, sf = amax / 448,
q = float8_e4m3fn(x * (1 / sf)) (torch's cast rounds to nearest even), and the checkpoint stores sf.
"""
from __future__ import annotations

from typing import Mapping

import torch


def reference_block(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One block (any shape up to the block size) -> (fp8 block, float32 scalar scale)."""
    amax = torch.max(torch.abs(x.to(torch.float32)))
    sf = torch.clamp(amax, min=1e-4) / 448.0
    return (x.to(torch.float32) * (1.0 / sf)).to(torch.float8_e4m3fn), sf


def reference_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D weight -> (fp8 weight, float32 weight_scale_inv [ceil(N/bn), ceil(K/bk)])."""
    n, k = w.shape
    bn, bk = block
    rows, cols = (n + bn - 1) // bn, (k + bk - 1) // bk
    q = torch.empty((n, k), dtype=torch.float8_e4m3fn)
    s = torch.empty((rows, cols), dtype=torch.float32)
    for i in range(rows):
        for j in range(cols):
            qb, sb = reference_block(w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk])
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = qb
            s[i, j] = sb
    return q, s


def reference_checkpoint(weights: Mapping[str, torch.Tensor], quantized: set[str] | frozenset[str],
                         block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The HF FP8 checkpoint of bf16 `weights`: each name in `quantized` as fp8 plus `<name>_scale_inv`, the rest
    as given."""
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if name in quantized:
            out[name], out[name + "_scale_inv"] = reference_quantize(w, block)
        else:
            out[name] = w
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8),
                                                                     b.view(-1).view(torch.uint8))
