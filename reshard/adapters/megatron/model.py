"""Reading a live megatron-core GPT model: its chunks, parameters, persistent buffers and layer numbers.

Names follow the Megatron layout's physical names: a chunk's own parameter names, prefixed `model{c}.` when
the model has several virtual pipeline chunks. Nothing here copies a tensor.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ...errors import LayoutError


def unwrap(model: Any) -> list[Any]:
    """The GPTModel chunks of `model` (one module or the list of virtual-pipeline chunks), without the DDP /
    Float16Module wrappers. Fully sharded data parallel is refused: its parameters are not whole TP shards."""
    from megatron.core.models.gpt import GPTModel

    wrappers, sharded = _wrapper_types()
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if not chunks:
        raise LayoutError("megatron", "no model chunks given")
    out = []
    for c, module in enumerate(chunks):
        while isinstance(module, wrappers):
            module = module.module
        if sharded and isinstance(module, sharded):
            raise LayoutError("megatron", f"chunk {c} is wrapped in {type(module).__name__}: fully sharded data "
                              "parallel splits parameters across data-parallel ranks, which the Megatron layout "
                              "does not describe", fix="refit from a model wrapped in megatron DDP instead")
        if not isinstance(module, GPTModel):
            raise LayoutError("megatron", f"chunk {c} is a {type(module).__name__}, not a megatron-core GPTModel")
        out.append(module)
    for c, module in enumerate(out):
        if len(out) > 1 and module.vp_stage != c:
            raise LayoutError("megatron", f"chunk {c} was built with vp_stage={module.vp_stage}; pass the "
                              "virtual pipeline chunks in order", values={"chunk": c, "vp_stage": module.vp_stage})
    return out


def _wrapper_types() -> tuple[tuple[type, ...], tuple[type, ...]]:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    sharded: list[type] = []
    try:
        from megatron.core.distributed import TorchFullyShardedDataParallel

        sharded.append(TorchFullyShardedDataParallel)
    except ImportError:  # optional in some megatron-core builds
        pass
    try:
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        sharded.append(FullyShardedDataParallel)
    except ImportError:
        pass
    return (DistributedDataParallel, Float16Module), tuple(sharded)


def chunk_prefix(chunk: int, num_chunks: int) -> str:
    return f"model{chunk}." if num_chunks > 1 else ""


def live_parameters(chunks: Sequence[Any]) -> dict[str, torch.nn.Parameter]:
    """Physical name -> the live parameter, for every chunk."""
    out = {}
    for c, chunk in enumerate(chunks):
        prefix = chunk_prefix(c, len(chunks))
        for name, param in chunk.named_parameters():
            out[prefix + name] = param
    return out


def state_buffers(chunks: Sequence[Any]) -> dict[str, torch.Tensor]:
    """Persistent buffers (part of the state dict, e.g. the router's `expert_bias`); non-persistent ones
    (token counters) are scratch and left out. TransformerEngine's `_extra_state` is not a buffer."""
    out = {}
    for c, chunk in enumerate(chunks):
        prefix = chunk_prefix(c, len(chunks))
        for mod_name, module in chunk.named_modules():
            for name, buf in module._buffers.items():
                if buf is not None and name not in module._non_persistent_buffers_set:
                    out[f"{prefix}{mod_name}.{name}" if mod_name else prefix + name] = buf
    return out


def live_tensors(chunks: Sequence[Any]) -> dict[str, torch.Tensor]:
    """Physical name -> live tensor a refit reads: the parameters and the persistent buffers (model state such
    as the router's `expert_bias`, which a family may place like any canonical tensor)."""
    return {**live_parameters(chunks), **state_buffers(chunks)}


def layer_numbers(chunks: Sequence[Any]) -> dict[tuple[int, int], int]:
    """(chunk, index in that chunk's decoder.layers) -> global layer index (TransformerLayer.layer_number - 1)."""
    return {(c, i): layer.layer_number - 1
            for c, chunk in enumerate(chunks) for i, layer in enumerate(chunk.decoder.layers)}
