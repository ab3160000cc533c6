"""An FP8 block-scaled vLLM engine as the destination of a quantizing refit (`reshard.planner.fp8`).

`fp8_problems(model, fp, rank)` compares the live model's parameters -- what vLLM's Fp8LinearMethod /
Fp8MoEMethod created: fp8 weights, float32 `weight_scale_inv` per block, the rest in the model's dtype -- with
the FP8 destination the plan declares for that rank (names, shapes, dtypes; every problem at once);
`bind_fp8(model, fp, rank)` returns the destination tensors (the parameters' storage) after that check, to hand
to `Fp8Executor`. Direct install writes the parameters as vLLM keeps them after `process_weights_after_loading`:
on NVIDIA GPUs vLLM's block-FP8 linear kernels keep the loaded (N, K) fp8 weight and float32 scales
(`process_fp8_weight_block_strategy` changes them only on FNUZ platforms, ROCm); backends that re-lay weights
out (the CPU AMX packing, e8m0 scale conversion) are not direct-install destinations: use the loader install
(an `HfLayout` destination: the FP8 checkpoint's tensors handed to `load_weights`).
"""
from __future__ import annotations


import torch

from ...errors import LayoutMismatchError
from ...planner.fp8 import Fp8Plan
from .live import dtype_name


def fp8_problems(model: torch.nn.Module, fp: Fp8Plan, rank: int) -> list[str]:
    """Differences between the model's parameters and the FP8 destination's tensors of `rank`."""
    full = fp.full_dst
    declared = full.rank_tensors(rank)
    params = dict(model.named_parameters())
    problems = []
    for name, shape in sorted(declared.items()):
        dtype = full.tensor_dtype(rank, name)
        p = params.get(name)
        if p is None:
            problems.append(f"{name}: declared {tuple(shape)} {dtype}, the model has no such parameter")
        elif tuple(p.shape) != tuple(shape) or dtype_name(p.dtype) != dtype:
            problems.append(f"{name}: the model has {tuple(p.shape)} {dtype_name(p.dtype)}, the FP8 destination "
                            f"declares {tuple(shape)} {dtype} ({fp.scheme.block[0]}x{fp.scheme.block[1]} blocks)")
    for name, p in sorted(params.items()):
        if name not in declared and (p.dtype == torch.float8_e4m3fn or name.endswith("_scale_inv")):
            problems.append(f"{name}: the model quantizes it ({tuple(p.shape)} {dtype_name(p.dtype)}), the FP8 "
                            f"destination does not (ignored modules differ?)")
    return problems


def bind_fp8(model: torch.nn.Module, fp: Fp8Plan, rank: int) -> dict[str, torch.Tensor]:
    """The destination tensors of `rank` for a direct FP8 install (the parameters' storage), after the check."""
    problems = fp8_problems(model, fp, rank)
    if problems:
        raise LayoutMismatchError("vllm", problems, fix="declare the engine's quantization_config (block size, "
                                  "ignored modules) and parallel sizes", where="the live FP8 model")
    params = dict(model.named_parameters())
    return {name: params[name].data for name in fp.full_dst.rank_tensors(rank)}


__all__ = ["bind_fp8", "fp8_problems"]
