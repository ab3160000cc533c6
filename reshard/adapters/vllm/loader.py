"""Loader install: the plan delivers whole HF-named canonical tensors (`HfLayout(replicas=N)`, one "replica" per
vLLM rank) into buffers kept between refits, and `install` hands them to the model's own `load_weights` one group of
whole modules at a time, inside vLLM's layerwise reload (which runs the post-load processing): for quantized or
re-packing backends. A transport failure happens before the install, so the model never sees a partial refit.
"""
from __future__ import annotations

from typing import Any

import torch

from ...errors import ExecutionError
from ...executors.reference import empty_for
from ...executors.shared import release_shared, shared_empty
from ...layouts import ModelSpec
from ...planner import Plan
from .live import config_scope, weights


def layer_groups(spec: ModelSpec) -> list[tuple[str, ...]]:
    """Canonical tensor names in groups that fill whole vLLM modules, in model order."""
    pre: list[str] = []
    post: list[str] = []
    layers: dict[int, list[str]] = {}
    for t in spec.tensors:
        if t.layer >= 0:
            layers.setdefault(t.layer, []).append(t.name)
        else:
            (post if layers else pre).append(t.name)
    groups = [pre] + [layers[i] for i in sorted(layers)] + [post]
    return [tuple(g) for g in groups if g]


class LoaderInstaller:
    """Loader install: buffers for whole canonical tensors that a refit fills, then handed to the model's own
    weight loaders (vLLM's layerwise reload)."""

    def __init__(self, model: torch.nn.Module, rank: int, plan: Plan, vllm_config: Any = None, shared: bool = False):
        self.model, self.rank, self.plan, self.vllm_config = model, rank, plan, vllm_config
        # the engine's device (after an interrupted reload, parameters can be on "meta")
        device = getattr(getattr(vllm_config, "device_config", None), "device", None)
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.buffers = empty_for(plan, rank, self.device)  # each in its own dtype (a float32 router bias too)
        self.shared = shared and self.device.type == "cpu"
        if self.shared:  # peers write them in place (the shared-memory transport)
            self.buffers = {n: shared_empty(tuple(t.shape), t.dtype) for n, t in self.buffers.items()}
        self.groups = layer_groups(plan.src.model)

    def close(self) -> None:
        """The session is over: shared buffers' names go (peers of a later session get buffers of their own)."""
        if self.shared:
            for t in self.buffers.values():
                release_shared(t)

    @torch.no_grad()
    def install(self) -> set[str]:
        """Hand the received tensors to the model inside vLLM's layerwise reload (which runs the post-load
        processing at its end); returns what vLLM loaded."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        with config_scope(self.vllm_config):
            # vLLM processes a fused-MoE layer's weights (the CPU backend pads and prepacks them) only while it has no
            # kernel: without one, the reload's post-processing builds and runs it as a first load does
            for module in self.model.modules():
                if getattr(getattr(module, "quant_method", None), "moe_kernel", None) is not None:
                    module.quant_method.moe_kernel = None
            initialize_layerwise_reload(self.model)
            try:
                return self.load()
            except Exception as e:
                raise ExecutionError(f"vLLM's load_weights failed ({type(e).__name__}: {e}); the engine serves a mix "
                                     f"of old and new weights until the next refit") from e
            finally:  # also when vLLM's own loaders failed half-way: the closed reload lets the model serve (modules
                # loaded so far hold the new weights, the others their old ones) instead of keeping "meta" parameters
                finalize_layerwise_reload(self.model, self.vllm_config.model_config)

    @torch.no_grad()
    def load(self) -> set[str]:
        """`load_weights` of the received tensors, group by group. Raises ExecutionError if some weight of the
        model was not loaded (vLLM skips names it does not know)."""
        loaded: set[str] = set()
        with config_scope(self.vllm_config):
            for group in self.groups:
                loaded |= set(self.model.load_weights([(name, self.buffers[name]) for name in group]) or ())
        # LoRA wraps a linear's weight as `<module>.base_layer.weight`; load_weights reports the unwrapped name
        missing = sorted({n.replace(".base_layer.", ".") for n in weights(self.model)} - loaded)
        if missing:
            raise ExecutionError(f"load_weights did not load {len(missing)} weights of the model, e.g. {missing[:5]}: "
                                 f"the canonical names do not match what this vLLM model loads")
        return loaded
