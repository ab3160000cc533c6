"""One worker's side of a reshard refit, independent of how vLLM drives it (the weight-transfer engine and
the worker extension both wrap this).

    session = WorkerSession(model, vllm_config, RefitSpec(...))   # checks everything; raises before bytes move
    session.start(); session.receive(); session.finish()          # one refit
    session.close()
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import LayoutError, LayoutMismatchError, PlanError
from ...layouts import HfLayout, Layout, ModelSpec, VllmLayout, layout_from_dict, layout_to_dict
from ...planner import Plan, compile_plan
from .derive import representative_layers
from .direct import DirectBinding, bind_direct
from .live import declared_layout, local_rank, spec_of
from .loader import LoaderInstaller, loader_plans
from .transport import Transport, make_transport

MODES = ("direct", "loader")


@dataclass
class RefitFields:
    """Everything both sides must agree on; plain data (JSON-able dicts) so it crosses RPC boundaries. The one
    list of these fields: RefitSpec and the weight-transfer init payloads (engine.py, trainer.py) inherit it."""

    model: dict[str, Any]  # ModelSpec fields
    src: dict[str, Any]  # source (trainer) layout, layout_to_dict
    dst: dict[str, Any]  # destination layout: vllm (direct mode) or hf with one replica per vLLM rank (loader)
    mode: str = "direct"
    replica: int = 0  # which replica of `dst` this engine is (engines of one refit get 0, 1, ...)
    transport: str = "inprocess"
    transport_options: dict[str, Any] = field(default_factory=dict)
    fanout: int | None = None
    verify_layers: list[int] | None = None  # layers whose loaders are probed; None: one layer of each kind
    plan_digest: str = ""  # the trainer's digest of the plan(s); checked when given


@dataclass
class RefitSpec(RefitFields):
    """A refit's agreed fields, and what follows from them: the layouts and the plans."""

    def layouts(self) -> tuple[Layout, Layout]:
        spec = ModelSpec(**self.model)
        src, dst = layout_from_dict({**self.src, "model": spec}), layout_from_dict({**self.dst, "model": spec})
        if self.mode not in MODES:
            raise LayoutError("vllm", f"mode={self.mode!r} is not one of {MODES}", {"mode": self.mode})
        want = VllmLayout if self.mode == "direct" else HfLayout
        if not isinstance(dst, want):
            raise LayoutError(dst.kind, f"{self.mode} mode needs a {want.kind} destination layout, got {dst}")
        return src, dst

    def plans(self) -> list[Plan]:
        src, dst = self.layouts()
        if self.mode == "direct":
            return [compile_plan(src, dst, fanout=self.fanout)]
        return loader_plans(src, dst, fanout=self.fanout)


def plans_digest(plans: list[Plan]) -> str:
    return hashlib.sha256("|".join(p.digest for p in plans).encode()).hexdigest()


def refit_spec(spec: ModelSpec, src: Layout, dst: Layout, **options: Any) -> RefitSpec:
    """A RefitSpec from layouts (model fields are carried once, not inside each layout)."""
    strip = lambda layout: {k: v for k, v in layout_to_dict(layout).items() if k != "model"}  # noqa: E731
    return RefitSpec(model=spec.model_dump(), src=strip(src), dst=strip(dst), **options)


class WorkerSession:
    def __init__(self, model: torch.nn.Module, vllm_config: Any, refit: RefitSpec):
        self.model, self.vllm_config, self.refit = model, vllm_config, refit
        src, dst = refit.layouts()
        self.src, self.dst = src, dst
        self._check_model(dst)
        self.plans = refit.plans()
        if refit.plan_digest and refit.plan_digest != plans_digest(self.plans):
            raise PlanError(f"the trainer's plan (digest {refit.plan_digest[:12]}) differs from the one this worker "
                            f"compiled ({plans_digest(self.plans)[:12]}): reshard versions or inputs differ")
        self.binding: DirectBinding | None = None
        self.installer: LoaderInstaller | None = None
        self.rank = local_rank(vllm_config, refit.replica)
        if not 0 <= self.rank < dst.num_ranks:
            raise LayoutError(dst.kind, f"this worker is rank {self.rank} of the destination, which has "
                                        f"{dst.num_ranks} ranks (check replica and replicas)")
        if refit.mode == "direct":
            layers = refit.verify_layers if refit.verify_layers is not None else representative_layers(dst.model)
            self.binding = bind_direct(model, dst, self.rank, layers, vllm_config)
        else:
            self.installer = LoaderInstaller(model, self.rank, self.plans, vllm_config)
        self.transport: Transport = make_transport(refit.transport, refit.transport_options)

    def _check_model(self, dst: Layout) -> None:
        """The trainer's model and destination layout must be what this worker serves."""
        live = spec_of(self.vllm_config)
        ours = dst.model.model_copy(update={"dtype": live.dtype})
        if ours != live:
            raise LayoutMismatchError(str(dst), [f"trainer: {dst.model}", f"vLLM: {live}"], where="the vLLM model")
        if isinstance(dst, VllmLayout):
            declared = declared_layout(dst.model, self.vllm_config, dst.replicas)
            if declared != dst:
                raise LayoutMismatchError(str(dst), [f"trainer declared {dst}, the engine runs {declared}"],
                                          where="this vLLM engine's parallel config")

    # --- one refit ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self.binding is not None:
            self.binding.verify()
        else:
            self.installer.start()

    def receive(self) -> None:
        if self.binding is not None:
            self.transport.run(self.plans[0], {self.rank: self.binding.tensors})
            self.binding.finish()
        else:
            self.installer.install(self.transport)

    def finish(self) -> None:
        if self.installer is not None:
            self.installer.finish()

    def close(self) -> None:
        self.transport.close()
