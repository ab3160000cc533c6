"""Reading a live vLLM model: its model family, weight parameters, parallel sizes, declared layout and rank (vllm
imported lazily). A model class named like an architecture of a registered `ModelFamily` is served from that family.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from ...errors import LayoutError
from ...layouts import ModelSpec, VllmLayout, discover, spec_from_hf_config, supported_architectures


def not_weights(model: Any) -> tuple[str, ...]:
    """The live parameters of a vLLM model that hold no model weights (formatted with the layer index `{i}`): its
    family's `vllm_not_weights`, the family found by the model's class name as an architecture. Buffers such as
    attention scales, rotary caches and `_expert_map` are not parameters and need no entry.

    Raises:
        LayoutError: no registered family reads this model class, listing those supported.
    """
    name = type(model).__name__
    if name not in supported_architectures():
        raise LayoutError("vllm", f"vLLM model class {name} has no reshard description; supported: "
                                  f"{', '.join(supported_architectures())}",
                          {"model_class": name}, "add a model family (README: Add a model family)")
    return discover({"architectures": [name]}).vllm_not_weights


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype's name without the torch. prefix."""
    return str(dtype).removeprefix("torch.")


def config_scope(vllm_config: Any) -> contextlib.AbstractContextManager:
    """vLLM's `set_current_vllm_config(vllm_config)` (nothing for None: a bare model in tests)."""
    if vllm_config is None:
        return contextlib.nullcontext()
    from vllm.config import set_current_vllm_config

    return set_current_vllm_config(vllm_config)


def layer_of(name: str) -> int:
    """The decoder layer a parameter belongs to: its first integer path segment (-1 for embeddings, final
    norm, lm_head). Structural, like vLLM's own per-layer grouping; no role is guessed from the name."""
    return next((int(part) for part in name.split(".") if part.isdigit()), -1)


def weights(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The model's weight parameters by name, each storage once (tied lm_head and the MoE runner's alias of
    the router appear under their first name only). Buffers are never weights."""
    skip = not_weights(model)
    out = dict(model.named_parameters())  # remove_duplicate=True: aliases once
    for i in sorted({layer_of(n) for n in out}):
        for template in skip:
            out.pop(template.format(i=i), None)
    return out


def spec_of(vllm_config: Any) -> ModelSpec:
    """The ModelSpec of the model a vLLM config serves, in the dtype vLLM runs it."""
    mc = vllm_config.model_config
    spec = spec_from_hf_config(mc.hf_config.to_dict())
    return spec.model_copy(update={"dtype": dtype_name(mc.dtype)})


def parallel_sizes(vllm_config: Any) -> tuple[int, bool]:
    """(tensor parallel size, expert parallel) of a vLLM config; the layouts reshard declares."""
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size != 1:
        raise LayoutError("vllm", f"pipeline_parallel_size={pc.pipeline_parallel_size}: reshard declares vLLM "
                                  f"layouts without pipeline parallelism", {"pp": pc.pipeline_parallel_size})
    return pc.tensor_parallel_size, bool(pc.enable_expert_parallel)


def declared_layout(spec: ModelSpec, vllm_config: Any, replicas: int = 1) -> VllmLayout:
    """The VllmLayout a vLLM config declares (each data-parallel rank or engine counted as a replica; EPLB's
    redundant experts counted, their current placement is the EPLB state's: experts.live_placement)."""
    tp, ep = parallel_sizes(vllm_config)
    pc = vllm_config.parallel_config
    if pc.data_parallel_size > 1 and spec.is_moe:
        raise LayoutError("vllm", f"data_parallel_size={pc.data_parallel_size} with a MoE model shards experts over "
                                  f"DP x TP, which VllmLayout does not declare", {"dp": pc.data_parallel_size})
    ep = ep and spec.is_moe
    redundant = pc.eplb_config.num_redundant_experts if ep and getattr(pc, "enable_eplb", False) else 0
    return VllmLayout(model=spec, tp=tp, expert_parallel=ep, replicas=replicas, redundant_experts=redundant)


def local_rank(vllm_config: Any, replica: int = 0) -> int:
    """This worker's rank in the destination layout: replica k's TP rank r is r + k * tp."""
    from vllm.distributed import get_tensor_model_parallel_rank

    tp, _ = parallel_sizes(vllm_config)
    pc = vllm_config.parallel_config
    dp_rank = pc.data_parallel_rank if pc.data_parallel_size > 1 else 0
    return (replica + dp_rank) * tp + get_tensor_model_parallel_rank()
