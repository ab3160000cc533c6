"""Loader mode: the plan delivers canonical tensors (full, HF-named) and the model's own `load_weights` places
them -- for quantized or re-packing backends, where vLLM's loaders and post-load processing must run.

The destination layout is `HfLayout(replicas=N)` with one "replica" per vLLM rank: `load_weights` needs the
full global tensor on every rank (a per-rank shard is silently misloaded). Tensors are delivered and loaded one
group at a time, each group filling whole modules (what precedes the layers, then each layer, then the final
norm and lm_head): vLLM's layerwise reload processes a module once all its elements arrived, and a module left
partly loaded in a session is processed with garbage in the rest.

Lifecycle inside a weight-update session (the engine does this):
  1. `start()`            initialize_layerwise_reload(model): checkpoint-format loading with deferred processing
  2. `install(transport)` per group: receive the group's canonical tensors, `model.load_weights(group)`
  3. `finish()`           finalize_layerwise_reload(model, model_config)
Not atomic: a transport failure in step 2 leaves the groups loaded so far in place (each group is received
completely before it is loaded, so no module is ever loaded from a partial transfer).
"""
from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch

from ...errors import ExecutionError
from ...executors.local import empty_for
from ...layouts import HfLayout, Layout, ModelSpec
from ...planner import Plan, compile_plan
from .live import weights
from .transport import Transport


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


def loader_layout(spec: ModelSpec, num_ranks: int) -> HfLayout:
    """One full copy of every canonical tensor per vLLM rank."""
    return HfLayout(model=spec, replicas=num_ranks)


def loader_plans(src: Layout, dst: HfLayout, **options: Any) -> list[Plan]:
    """One plan per group of `layer_groups`; trainer and workers compile the same list."""
    return [compile_plan(src, dst, tensors=group, **options) for group in layer_groups(src.model)]


class LoaderInstaller:
    def __init__(self, model: torch.nn.Module, rank: int, plans: Sequence[Plan], vllm_config: Any = None):
        self.model, self.rank, self.plans, self.vllm_config = model, rank, list(plans), vllm_config
        self.device = next(model.parameters()).device

    def _scope(self) -> contextlib.AbstractContextManager:
        if self.vllm_config is None:
            return contextlib.nullcontext()
        from vllm.config import set_current_vllm_config

        return set_current_vllm_config(self.vllm_config)

    def start(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with self._scope():
            finalize_layerwise_reload(self.model, self.vllm_config.model_config)

    @torch.no_grad()
    def install(self, transport: Transport) -> set[str]:
        """Receive each group's canonical tensors and hand them to `load_weights`; returns what vLLM loaded.
        Raises ExecutionError if some weight of the model was not loaded (vLLM skips names it does not know)."""
        loaded: set[str] = set()
        for plan in self.plans:
            group = empty_for(plan, self.rank, self.device)  # each in its dtype (a float32 router bias too)
            transport.run(plan, {self.rank: group})
            with self._scope():
                loaded |= set(self.model.load_weights(list(group.items())) or ())
            del group
        missing = sorted(set(weights(self.model)) - loaded)
        if missing:
            raise ExecutionError(f"load_weights did not load {len(missing)} weights of the model, e.g. {missing[:5]}: "
                                 f"the canonical names do not match what this vLLM model loads")
        return loaded
