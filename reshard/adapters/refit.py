"""What both sides of a refit agree on (`RefitSpec`, plain JSON data), and the executor that moves its bytes.

The spec travels from the trainer to every engine worker; each side rebuilds the layouts, compiles the same plan
and compares its digest with the trainer's. The engine's layout is any registered layout whose `installs` hold the
install: "direct" (the plan writes the engine's parameters), "loader" (whole canonical tensors per engine rank,
placed by the engine's weight loaders) or "lora_slot" (an adapter into the slot of the served adapter `lora_id`).
Cross-process transports: trainer process p plays source rank p, process S + d destination rank d (S: the
trainer's ranks). Imports no vLLM.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..arguments import instance
from ..errors import ArgumentError, ExecutionError, LayoutError, PlanError
from ..executors.base import Executor, RankTensors
from ..executors.binding import Binding
from ..layouts import HfLayout, Layout, ModelSpec, layout_from_dict, layout_to_dict, registered_layouts
from ..layouts.expert_placement import ExpertPlacement
from ..planner import Plan
from ..planner.cache import cached_plan
from . import transports
from .rendezvous import Rendezvous, from_untrusted
_FIELDS = {"model": dict, "src": dict, "dst": dict, "install": str, "replica": int, "transport": str,
           "options": dict, "rendezvous": (dict, type(None)), "fanout": (int, type(None)),
           "verify_layers": (list, tuple, type(None)), "plan_digest": str, "lora_id": (int, type(None)),
           "math": (dict, type(None)), "staging": (str, type(None)), "delta": (int, type(None))}


@dataclass(frozen=True)
class RefitSpec:
    """What a trainer and the engines it refits agree on, as JSON-able data (usually made with `RefitSpec.of`).

    Args:
        model: the `ModelSpec`'s fields.
        src: the trainer's layout (without the model).
        dst: the engine's layout (without the model): any registered layout whose `installs` hold `install`.
        install: "direct", "loader", "lora_slot", or an install a registered layout declares.
        replica: which replica of `dst` this engine is (engines of one refit get 0, 1, ...).
        transport: a registered transport (adapters.transports).
        options: executor options (e.g. `{"timeout": 60}`, `{"checksum": "sha256"}`).
        rendezvous: the cross-process transports' meeting point (filled in by `TrainerSession`).
        fanout: relay tree width across replicas (None: the trainer feeds every replica).
        verify_layers: layers whose loaders a direct install probes (None: one per tensor kind).
        plan_digest: the trainer's plan digest; a worker that compiles another plan refuses the refit.
        lora_id: for "lora_slot", the engine's id of the served adapter whose slot is refit.
        math: the HF config fields that change the math but no shape; a worker whose model differs refuses the
            refit. None: not checked.
        staging: where engine workers stage the bytes before the install makes them live: None (streamed),
            "device" or "host" (direct installs only); what `TrainerSession(pause_for="flip")` needs.
        delta: delta refits with a dense keyframe every this many versions (None: every refit dense); needs a
            transport that carries it and no fanout.

    Raises:
        PlanError: a field of the wrong type, an unknown install or transport, or a field that is not JSON.
    """

    model: dict[str, Any]
    src: dict[str, Any]
    dst: dict[str, Any]
    install: str = "direct"
    replica: int = 0
    transport: str = "collective"
    options: dict[str, Any] = field(default_factory=dict)
    rendezvous: dict[str, Any] | None = None
    fanout: int | None = None
    verify_layers: tuple[int, ...] | None = None
    plan_digest: str = ""
    lora_id: int | None = None
    math: dict[str, Any] | None = None
    staging: str | None = None
    delta: int | None = None

    def __post_init__(self) -> None:
        problems = []
        for name, kind in _FIELDS.items():
            value = getattr(self, name)
            if not isinstance(value, kind) or isinstance(value, bool):
                problems.append(f"{name}={value!r} has type {type(value).__name__}")
        for name in ("options", "math", "rendezvous"):
            value = getattr(self, name)
            if isinstance(value, dict) and not all(isinstance(k, str) for k in value):
                problems.append(f"{name}={value!r} must have string keys (it travels as a JSON object)")
        installs = sorted({i for cls in registered_layouts().values() for i in cls.installs})
        if self.install not in installs:
            problems.append(f"install={self.install!r} is not one of the registered layouts' installs {installs}")
        if self.transport not in transports.transports():
            problems.append(f"transport={self.transport!r} is not one of the registered transports "
                            f"{list(transports.transports())}")
        if isinstance(self.fanout, int) and not isinstance(self.fanout, bool) and self.fanout < 1:
            problems.append(f"fanout={self.fanout} must be >= 1 (or None: the trainer feeds every replica)")
        if isinstance(self.replica, int) and self.replica < 0:
            problems.append(f"replica={self.replica} must be >= 0")
        if (self.install == "lora_slot") != (self.lora_id is not None) or isinstance(self.lora_id, bool) \
                or (isinstance(self.lora_id, int) and self.lora_id < 1):
            problems.append(f"lora_id={self.lora_id!r}: install='lora_slot' needs the served adapter's id (a "
                            f"positive integer), and only it")
        if self.staging not in (None, "device", "host") or (self.staging is not None and self.install not in (
                "direct", "loader")) or (self.staging == "host" and self.install != "direct"):
            problems.append(f"staging={self.staging!r}: None, 'device' (direct or loader installs) or 'host' "
                            f"(direct installs: a loader install stages in its buffers on the engine's device); "
                            f"install={self.install!r}")
        if isinstance(self.delta, int) and not isinstance(self.delta, bool):
            problems += _delta_problems(self)
        if isinstance(self.options, dict) and "delta" in self.options:
            problems.append("options['delta']: delta refits are RefitSpec(delta=K), a dense keyframe every K versions")
        if isinstance(self.verify_layers, (list, tuple)):  # (another type: refused by _FIELDS above)
            object.__setattr__(self, "verify_layers", tuple(self.verify_layers))
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in self.verify_layers):
                problems.append("verify_layers must list layer numbers")
        if problems:
            raise PlanError("invalid refit spec", problems)
        for name in ("model", "src", "dst", "options", "rendezvous", "math"):  # JSON values, as they travel
            try:
                object.__setattr__(self, name, json.loads(json.dumps(getattr(self, name))))
            except (TypeError, ValueError) as e:
                raise PlanError(f"refit spec field {name} is not JSON: {e}") from None
        self.layouts()  # the model and both layouts are valid (each raises its own library error)
        if self.rendezvous is not None:
            Rendezvous.from_dict(self.rendezvous)

    @classmethod
    def of(cls, spec: ModelSpec, src: Layout, dst: Layout, *, config: Any = None, **fields: Any) -> "RefitSpec":
        """The spec of a refit between two layouts of one model; `math` comes from `config`, else `spec.math`.

        Args:
            spec: the model.
            src: the trainer's layout.
            dst: the engine's layout (a registered layout that accepts the install).
            config: the HF config of the spec's model (a dict, config.json or checkpoint directory), for a spec
                that does not carry its math.
            **fields: any other `RefitSpec` field (install, transport, options, fanout, math, ...).

        Returns:
            The spec.

        Raises:
            ArgumentError: an argument of the wrong kind, a config that is not the spec's model's, or both
                `config` and `math`.
            PlanError: a field `RefitSpec` refuses.
        """
        instance("spec", spec, ModelSpec, "a ModelSpec")
        instance("src", src, Layout, "a Layout (the trainer's)")
        instance("dst", dst, Layout, "a Layout (the engine's)")
        instance("config", config, (dict, str, Path), "an HF config (a dict, config.json or a checkpoint directory)",
                 none=True)
        strip = lambda layout: {k: v for k, v in layout_to_dict(layout).items() if k != "model"}  # noqa: E731
        rdv = fields.get("rendezvous")
        if rdv is not None and not isinstance(rdv, dict):
            fields["rendezvous"] = rdv.to_dict()
        if config is not None:
            if "math" in fields:
                raise ArgumentError("config", str(config)[:200] if not isinstance(config, dict) else "<a dict>",
                                    "and math= are both given: pass one (config's math fields are what math holds)")
            fields["math"] = _config_math(spec, config)
        elif "math" not in fields:
            fields["math"] = spec.math  # ModelSpec.from_hf_config's; None for a spec made field by field
        return cls(model=spec.model_dump(), src=strip(src), dst=strip(dst), **fields)

    def to_dict(self) -> dict[str, Any]:
        """The spec as JSON-able data (what travels to the engines)."""
        d = asdict(self)
        d["verify_layers"] = list(self.verify_layers) if self.verify_layers is not None else None
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "RefitSpec":
        """The spec from `to_dict`'s data (untrusted: PlanError names a bad or unknown field)."""
        return from_untrusted(cls, d, "refit spec", PlanError)

    def with_expert_placement(self, placement: ExpertPlacement | None) -> "RefitSpec":
        """This refit for an EPLB engine whose experts now sit as `placement` says (None: vLLM's initial one),
        its plan digest cleared (init again with it).

        Raises:
            ArgumentError: `placement` is not an ExpertPlacement (or None).
            LayoutError: the placement is not the engine's (other experts, EP size, MoE layers or redundancy), or
                the engine's layout has no expert parallelism.
        """
        instance("placement", placement, ExpertPlacement, "an ExpertPlacement", none=True)
        _, dst = self.layouts()
        if "expert_placement" not in type(dst).model_fields:
            raise LayoutError(dst.engine, f"the engine layout {dst} places no experts by an EPLB placement",
                              {"engine": dst.engine})
        update: dict[str, Any] = {"expert_placement": placement}
        if placement is not None:  # EPLB keeps its redundancy; a placement of another is refused by the layout
            update["redundant_experts"] = placement.redundant
        new = dst.model_copy(update=update)
        return replace(self, dst={k: v for k, v in layout_to_dict(new).items() if k != "model"}, plan_digest="")

    def layouts(self) -> tuple[Layout, Layout]:
        """(the trainer's layout, the engine's), each validated by its own class.

        Raises:
            LayoutError: a layout its class refuses, or an engine layout that does not accept the install.
        """
        spec = ModelSpec(**self.model)
        src, dst = layout_from_dict({**self.src, "model": spec}), layout_from_dict({**self.dst, "model": spec})
        if self.install not in dst.installs:
            accepts = f"accepts install {list(dst.installs)}" if dst.installs else "is not a refit destination"
            raise LayoutError(dst.engine, f"install={self.install!r} with the engine layout {dst}: a {dst.engine} "
                              f"layout {accepts}", {"install": self.install})
        return src, dst

    @property
    def cross_process(self) -> bool:
        """Whether the transport's processes meet at a rendezvous."""
        return transports.transport(self.transport).cross_process

    def destination(self) -> Layout:
        """The plan's destination: the engine's layout, or (loader) whole tensors per engine rank."""
        _, dst = self.layouts()
        return HfLayout(model=dst.model, replicas=dst.num_ranks) if self.install == "loader" else dst

    def plan(self) -> Plan:
        """The refit's plan (compiled once per process for these layouts and options)."""
        src, _ = self.layouts()
        return cached_plan(src, self.destination(), fanout=self.fanout)

    def agreed_plan(self, where: str = "this worker") -> Plan:
        """The plan, if it is the trainer's (`plan_digest`, when set).

        Raises:
            PlanError: `where` compiled another plan (reshard versions or inputs differ).
        """
        plan = self.plan()
        if self.plan_digest and self.plan_digest != plan.digest:
            raise PlanError(f"the trainer's plan (digest {self.plan_digest[:12]}) differs from the one {where} "
                            f"compiled ({plan.digest[:12]}): reshard versions or inputs differ")
        return plan

    @property
    def num_processes(self) -> int:
        """Cross-process transports: trainer processes + engine workers."""
        plan = self.plan()
        return plan.src.num_ranks + plan.dst.num_ranks


def _delta_problems(refit: RefitSpec) -> list[str]:
    """Why `refit.delta` (an int) cannot be carried."""
    problems = []
    if refit.install == "lora_slot":
        problems.append(f"delta={refit.delta} with install='lora_slot': the install scales the slot's B in place, so "
                        f"the engine no longer holds the version a delta would be computed against")
    if not 1 <= refit.delta <= 1 << 30:
        problems.append(f"delta={refit.delta}: a dense keyframe every K >= 1 versions (or None: every refit dense)")
    if refit.fanout is not None:
        problems.append(f"delta={refit.delta} with fanout={refit.fanout}: delta refits need a plan without fan-out "
                        f"(relays between replicas); set fanout=None")
    if refit.transport in transports.transports() and not transports.transport(refit.transport).delta:
        delta_ones = [n for n in transports.transports() if transports.transport(n).delta]
        problems.append(f"delta={refit.delta}: transport {refit.transport!r} does not carry delta refits (those "
                        f"that do: {delta_ones})")
    return problems


def _config_math(spec: ModelSpec, config: Any) -> dict[str, Any]:
    """The math fields of `config`, which must be the config of `spec`'s model (or of the model an adapter adapts)."""
    from ..layouts.lora import FAMILY, base_spec
    from ..layouts.math_config import math_config
    from ..layouts.registry import read_hf_config, spec_from_hf_config

    config = read_hf_config(config)
    model = base_spec(spec) if spec.family == FAMILY else spec
    if spec_from_hf_config(config).model_copy(update={"dtype": model.dtype}) != model:
        raise ArgumentError("config", "<the HF config>", f"is not the config of the model {model}")
    return math_config(config)


def open_transport(refit: RefitSpec, process: int, src: RankTensors, dst: RankTensors, *, store: Any = None,
                   group: Any = None) -> Executor:
    """This process's executor for the refit (trainer and worker side alike), over the refit's transport.

    Args:
        refit: the refit.
        process: this process's place in the refit.
        src, dst: this process's source / destination tensors (rank -> name -> tensor).
        store: the rendezvous's store (cross-process transports), already joined.
        group: the world group of the engine's workers ("colocated").

    Raises:
        ExecutionError: a cross-process transport without a rendezvous, or what the executor refuses.
    """
    from ..executors.delta import DeltaPolicy

    plan, options, chosen = refit.plan(), dict(refit.options), transports.transport(refit.transport)
    if refit.install == "loader" or refit.staging:  # buffers or staging, read only after a complete refit: in place
        options = {**chosen.in_place, **options}
    # cross-process: trainer process p plays source rank p, process S + d destination rank d; else shared ranks
    binding = (Binding.disjoint if chosen.cross_process else Binding.colocated)(plan.src.num_ranks, plan.dst.num_ranks)
    # (a cross-process transport without a rendezvous: refused by transports.open_transport)
    rdv = Rendezvous.from_dict(refit.rendezvous) if chosen.cross_process and refit.rendezvous is not None else None
    if rdv is not None:
        options.setdefault("timeout", rdv.timeout)
    return transports.open_transport(refit.transport, transports.Endpoint(
        plan, binding, process, src, dst, options, store=store, rendezvous=rdv, group=group,
        delta=None if refit.delta is None else DeltaPolicy(keyframe_every=refit.delta)))


__all__ = ["RefitSpec", "open_transport"]
