"""Which live parameters may be written in place: those still in the layout their loader wrote, not re-laid out by
vLLM's post-load processing (`process_weights_after_loading`). Fail-closed per quant method:
  - unquantized linear / embedding: kept on CUDA; refused on CPU once dispatched to a packed GEMM (`cpu_linear`);
  - unquantized fused MoE: kept before processing and by the TRITON / BATCHED_TRITON backends only;
  - any other quant method, and any non-contiguous storage: refused.
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
