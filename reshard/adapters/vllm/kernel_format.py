"""Which live parameters may be written in place: those whose storage is still in the layout their loader
wrote (the "checkpoint-loaded" layout VllmLayout declares), not re-laid out by post-load processing.

After `load_weights`, vLLM runs each module's `quant_method.process_weights_after_loading`, which may repack, pad,
transpose or swap weights into a kernel format. What is detected here (the tested vLLM version:
docs/guides/layouts.md, Versions), per module type, fail-closed (a quant method not listed is refused):
  - UnquantizedLinearMethod / UnquantizedEmbeddingMethod: nothing on CUDA. On CPU, a module that went through
    `dispatch_cpu_unquantized_gemm` (it has `cpu_linear`) computes from a packed copy (oneDNN, sgl, zentorch;
    linear weights are even replaced by empty ones) -> refused. XPU's opt-in transpose and ROCm's padding
    leave non-contiguous storage -> refused as non-contiguous.
  - UnquantizedFusedMoEMethod: before processing (`moe_kernel is None`) the experts hold the loader layout.
    After it, only the TRITON and BATCHED_TRITON backends keep [w1; w3] / w2 as loaded (the H100/H200
    default); FLASHINFER_CUTLASS stores [w3; w1], FLASHINFER_TRTLLM pads and block-permutes, AITER shuffles,
    CPU pads and prepacks, XPU transposes, MoonEP re-splits -> refused.
  - any other quant method (quantized checkpoints, out-of-tree layers) -> refused.
Shapes changed by processing (padding) are also caught by the structure check (check.py).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

_MOE_AS_LOADED = ("TRITON", "BATCHED_TRITON")


def _on_cpu_dispatched(module: torch.nn.Module, method: Any) -> str | None:
    if hasattr(module, "cpu_linear"):
        return (f"{type(method).__name__} on CPU dispatched it to a CPU GEMM kernel that may compute from a "
                f"packed copy of the weight")
    return None


def _moe(module: torch.nn.Module, method: Any) -> str | None:
    if method.moe_kernel is None:
        return None  # not processed yet: the experts hold what the loader wrote
    backend = getattr(method.unquantized_backend, "name", str(method.unquantized_backend))
    if backend in _MOE_AS_LOADED:
        return None
    return f"MoE backend {backend} re-lays the expert weights after loading (only {_MOE_AS_LOADED} keep them)"


def _rules() -> dict[type, Callable[[torch.nn.Module, Any], str | None]]:
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return {UnquantizedLinearMethod: _on_cpu_dispatched, UnquantizedEmbeddingMethod: _on_cpu_dispatched,
            UnquantizedFusedMoEMethod: _moe}


def relaid_problems(model: torch.nn.Module, params: dict[str, torch.nn.Parameter],
                    names: Iterable[str] | None = None) -> list[str]:
    """One line per parameter that must not be written in place, saying why (empty: all may be)."""
    rules = _rules()
    problems = []
    for name in sorted(params if names is None else names):
        p = params[name]
        if not p.is_contiguous():
            problems.append(f"{name}: storage is not contiguous (re-laid out after loading)")
            continue
        module_name = name.rpartition(".")[0]
        module = model.get_submodule(module_name) if module_name else model
        method = getattr(module, "quant_method", None)
        if method is None:
            continue  # a plain parameter (norms): no post-load processing
        rule = rules.get(type(method))
        why = (f"quant method {type(method).__name__} is not known to keep the loaded layout" if rule is None
               else rule(module, method))
        if why:
            problems.append(f"{name}: {why}")
    return problems
