"""An FP8 block-scaled vLLM engine as the destination of a quantizing refit (`reshard.planner.fp8`): the live
parameters (what vLLM's Fp8LinearMethod / Fp8MoEMethod keep on NVIDIA GPUs) checked against the plan's FP8
destination, then bound for `Fp8Executor`. Backends that re-lay the weights out take the loader install instead.
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
