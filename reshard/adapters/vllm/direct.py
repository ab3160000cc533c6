"""Direct mode: a plan writes straight into a live vLLM model's parameter storage.

    binding = bind_direct(model, layout, rank)             # checks, then binds; raises before anything moves
    transport.run(plan, {rank: binding.tensors})           # any executor: name -> tensor of this rank
    binding.finish()                                       # vocab padding rows zeroed, widened tensors cast

A parameter kept in a wider float type than the plan's (derive.widens) is bound to scratch in the plan's dtype and
cast into the parameter by `finish`. Parameters re-laid out by vLLM's post-load processing
(`process_weights_after_loading`) are refused, fail-closed per quant method (`relaid_problems`):
  - unquantized linear / embedding: kept on CUDA; refused on CPU once dispatched to a packed GEMM (`cpu_linear`);
  - unquantized fused MoE: kept before processing and by the TRITON / BATCHED_TRITON backends only;
  - any other quant method, and any non-contiguous storage: refused.
An FP8 block-scaled engine (`reshard.planner.fp8`) is bound by `bind_fp8` for `Fp8Executor`: what vLLM's
Fp8LinearMethod / Fp8MoEMethod keep on NVIDIA GPUs; backends that re-lay FP8 weights out take the loader install.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ...errors import KernelFormatError, LayoutMismatchError
from ...executors.reference import torch_dtype
from ...layouts import Layout
from .derive import check_layout, declared_placements
from .live import dtype_name, weights

if TYPE_CHECKING:
    from ...planner.fp8 import Fp8Plan


@dataclass
class DirectBinding:
    """A worker's destination tensors bound to the live storage of its vLLM model's parameters (install
    "direct"), with the padding no placement covers and the wider storages a cast lands in."""

    rank: int
    layout: Layout
    tensors: dict[str, torch.Tensor]  # the live storage of each parameter (param.data), plan destination names
    model: torch.nn.Module
    padding: dict[str, list[tuple[int, int]]]  # name -> flat (start, length) runs no placement covers
    casts: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> the wider parameter storage

    def verify(self) -> None:
        """Raise KernelFormatError if a bound tensor is no longer the storage its parameter uses."""
        live = weights(self.model)
        problems = [f"{name}: the model no longer has this parameter" for name in sorted(set(self.tensors) - set(live))]
        for name, t in self.tensors.items():
            p = live.get(name)
            if p is None:
                continue
            t = self.casts.get(name, t)
            if p.data.data_ptr() != t.data_ptr() or p.shape != t.shape or p.dtype != t.dtype:
                problems.append(f"{name}: the parameter's storage changed since it was bound "
                                f"(now {tuple(p.shape)} {p.dtype} at another address)")
        if problems:
            raise KernelFormatError(str(self.layout), problems, where=f"rank {self.rank} of the live vLLM model")

    @torch.no_grad()
    def finish(self) -> None:
        """After a refit landed: zero the padding (a direct refit never writes it), cast widened tensors into their
        parameters."""
        for name, runs in self.padding.items():
            flat = self.tensors[name].view(-1)
            for start, length in runs:
                flat.narrow(0, start, length).zero_()
        for name, target in self.casts.items():
            target.copy_(self.tensors[name])


def bind_direct(model: torch.nn.Module, layout: Layout, rank: int, layers: Sequence[int] | None = None,
                vllm_config: Any = None) -> DirectBinding:
    """Check the live model against `layout` (structure and the loaders' placements for `layers`, default all) and
    that no parameter was re-laid out; then bind its storage."""
    params = weights(model)  # read once: the checks and the binding below see the same parameters
    check_layout(model, layout, rank, layers, vllm_config, params)
    problems = relaid_problems(model, params)
    if problems:
        raise KernelFormatError(str(layout), problems, where=f"rank {rank} of the live vLLM model")
    tensors = {name: p.data for name, p in params.items()}
    want = {name: torch_dtype(layout.tensor_dtype(rank, name)) for name in tensors}  # a float32 router bias: own
    casts = {name: t for name, t in tensors.items() if t.dtype != want[name]}  # check_layout allowed only widening
    for name, t in casts.items():
        tensors[name] = torch.empty(t.shape, dtype=want[name], device=t.device)
    return DirectBinding(rank, layout, tensors, model, padding_runs(layout, rank), casts)


def padding_runs(layout: Layout, rank: int) -> dict[str, list[tuple[int, int]]]:
    """For each tensor of `rank` that placements do not fill, the flat runs of elements they leave uncovered."""
    shapes = layout.rank_tensors(rank)
    boxes: dict[str, list] = {name: [] for name in shapes}
    for _, p in declared_placements(layout, rank, layout.model.tensors):
        boxes[p.tensor].append(p)
    out = {}
    for name, shape in shapes.items():
        if sum(math.prod(p.lengths) for p in boxes[name]) >= math.prod(shape):
            continue
        mask = torch.zeros(shape, dtype=torch.bool)
        for p in boxes[name]:
            view = mask
            lead = len(shape) - len(p.lengths)
            for o in p.phys_offset[:lead]:
                view = view.select(0, o)
            for dim, (o, n) in enumerate(zip(p.phys_offset[lead:], p.lengths)):
                view = view.narrow(dim, o, n)
            view.fill_(True)
        edge = torch.zeros(1, dtype=torch.int8)  # uncovered runs start where this steps up, stop where it steps down
        steps = torch.diff(torch.cat([edge, (~mask.view(-1)).to(torch.int8), edge]))
        starts, stops = (torch.nonzero(steps == s).flatten().tolist() for s in (1, -1))
        out[name] = [(a, b - a) for a, b in zip(starts, stops)]
    return out


_MOE_AS_LOADED = ("TRITON", "BATCHED_TRITON")


def _why_relaid(module: torch.nn.Module, method: Any) -> str | None:
    """Why `module`'s quant method may have re-laid its weights out after loading (None: it keeps them)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    kind = type(method)
    if kind in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod):
        return (f"{kind.__name__} on CPU dispatched it to a CPU GEMM kernel that may compute from a packed copy of "
                f"the weight") if hasattr(module, "cpu_linear") else None
    if kind is not UnquantizedFusedMoEMethod:
        return f"quant method {kind.__name__} is not known to keep the loaded layout"
    if method.moe_kernel is None:
        return None  # not processed yet: the experts hold what the loader wrote
    backend = getattr(method.unquantized_backend, "name", str(method.unquantized_backend))
    return None if backend in _MOE_AS_LOADED else (f"MoE backend {backend} re-lays the expert weights after loading "
                                                   f"(only {_MOE_AS_LOADED} keep them)")


def relaid_problems(model: torch.nn.Module, params: dict[str, torch.nn.Parameter]) -> list[str]:
    """One line per parameter that must not be written in place, saying why (empty: all may be)."""
    problems = []
    for name in sorted(params):
        if not params[name].is_contiguous():
            problems.append(f"{name}: storage is not contiguous (re-laid out after loading)")
            continue
        module_name = name.rpartition(".")[0]
        module = model.get_submodule(module_name) if module_name else model
        method = getattr(module, "quant_method", None)  # None: a plain parameter (norms), never processed
        why = _why_relaid(module, method) if method is not None else None
        if why:
            problems.append(f"{name}: {why}")
    return problems


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
    return problems + [f"{name}: the model quantizes it ({tuple(p.shape)} {dtype_name(p.dtype)}), the FP8 destination "
                       f"does not (ignored modules differ?)" for name, p in sorted(params.items())
                       if name not in declared and (p.dtype == torch.float8_e4m3fn or name.endswith("_scale_inv"))]


def bind_fp8(model: torch.nn.Module, fp: Fp8Plan, rank: int) -> dict[str, torch.Tensor]:
    """The destination tensors of `rank` for a direct FP8 install (the parameters' storage), after the check."""
    problems = fp8_problems(model, fp, rank)
    if problems:
        raise LayoutMismatchError("vllm", problems, fix="declare the engine's quantization_config (block size, "
                                  "ignored modules) and parallel sizes", where="the live FP8 model")
    params = dict(model.named_parameters())
    return {name: params[name].data for name in fp.full_dst.rank_tensors(rank)}
