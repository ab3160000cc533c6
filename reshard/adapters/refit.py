"""What both sides of a refit agree on, as plain data, and the transports that move its bytes.

A `RefitSpec` travels from the trainer to every inference worker (in vLLM's init payload, through HTTP, Ray or
`collective_rpc`) as JSON: the model, the trainer's layout, the engine's layout, how the bytes are installed,
which engine replica this is, the transport and where its processes meet. Each side rebuilds the layouts, compiles
the same plan (once per process: planner.cache) and compares its digest with the trainer's. Imports no vLLM.

The engine's layout is any registered layout (layouts.registry.register_layout) that accepts the install
(`Layout.installs`): a new engine is a module that registers its layout, never an edit here.

Install (the built-in engines'):
  "direct"     the plan writes the engine's parameters (destination: the engine's layout);
  "loader"     the plan delivers whole canonical tensors to every engine rank (destination: HfLayout, one replica
               per engine rank), and the engine's own weight loaders place them (quantized or re-packing engines);
  "lora_slot"  a LoRA adapter (`layouts.lora.lora_spec`) into the slot of the adapter `lora_id` the engine already
               serves (destination: the engine's VllmLoraLayout; adapters.lora.slots); the model is untouched.

Transports: `transport` names one registered in adapters.transports (which lists them), `options` go to its
executor. For the cross-process ones, trainer process p plays source rank p and the worker of destination rank d
is process S + d (S = the trainer's ranks); everyone meets at `rendezvous` (adapters.rendezvous).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..errors import ArgumentError, ExecutionError, LayoutError, PlanError
from ..executors.base import Executor, RankTensors
from ..executors.binding import Binding
from ..layouts import HfLayout, Layout, ModelSpec, layout_from_dict, layout_to_dict, registered_layouts
from ..layouts.expert_placement import ExpertPlacement
from ..planner import Plan
from ..planner.cache import cached_plan
from . import transports
_FIELDS = {"model": dict, "src": dict, "dst": dict, "install": str, "replica": int, "transport": str,
           "options": dict, "rendezvous": (dict, type(None)), "fanout": (int, type(None)),
           "verify_layers": (list, tuple, type(None)), "plan_digest": str, "lora_id": (int, type(None)),
           "math": (dict, type(None)), "staging": (str, type(None)), "delta": (int, type(None))}


@dataclass(frozen=True)
class RefitSpec:
    """What a trainer and the engines it refits agree on, as plain JSON-able data (sent to every engine at init).

    Usually made with `RefitSpec.of(spec, trainer_layout, engine_layout, ...)`; `plan()` compiles (and caches)
    the plan both sides derive from it.

    Args:
        model: the `ModelSpec`'s fields.
        src: the trainer's layout (without the model).
        dst: the engine's layout (without the model): any registered layout whose `installs` hold `install`.
        install: how a worker lands the bytes: "direct" (into the parameters), "loader" (whole tensors through
            vLLM's `load_weights`), "lora_slot" (an adapter's slot), or an install a registered layout declares.
        replica: which replica of `dst` this engine is (engines of one refit get 0, 1, ...).
        transport: a registered transport (adapters.transports): "inprocess", "colocated", "collective", "nixl",
            "shared", or one registered since.
        options: executor options (e.g. `{"timeout": 60}`, `{"checksum": "sha256"}`).
        rendezvous: the cross-process transports' meeting point (filled in by `TrainerSession`).
        fanout: relay tree width across replicas (None: the trainer feeds every replica).
        verify_layers: layers whose loaders a direct install probes (None: one per tensor kind).
        plan_digest: the trainer's plan digest; a worker that compiles another plan refuses the refit.
        lora_id: for "lora_slot", the engine's id of the served adapter whose slot is refit.
        math: the trainer's HF config fields that change the math but no shape (`RefitSpec.of` fills it from the
            spec, `ModelSpec.math`, or its `config`); a worker whose model sets any of them otherwise refuses the
            refit at init. None: not checked.
        staging: where each engine worker stages the bytes before they go live (adapters.vllm.staging): None
            (streamed: direct installs commit as soon as every byte landed, loader installs fill their buffers),
            "device" (a copy of the worker's own shard beside its weights; a loader install's buffers) or "host"
            (pinned host memory, direct installs). Staged, a worker's transfer runs while its engine keeps
            generating, and the bytes go live only at the install step (the flip): `TrainerSession(pause_for=
            "flip")`. Checked at init against the memory free there.
        delta: delta refits with a dense keyframe every this many versions (executors.delta.DeltaPolicy's
            keyframe_every): only the elements that changed since the version the engine holds move, written in
            place into what the transport fills (parameters, staging or loader buffers); the first refit after
            every init is a keyframe. None: every refit dense. Needs a transport that carries it and no fanout.

    Raises:
        PlanError: a field of the wrong type, an unknown install or transport, or a field that is not JSON.
    """

    model: dict[str, Any]  # (each field: see Args)
    src: dict[str, Any]  # layout_to_dict, without the model
    dst: dict[str, Any]
    install: str = "direct"
    replica: int = 0
    transport: str = "collective"
    options: dict[str, Any] = field(default_factory=dict)  # "key": the inprocess / distributed publication
    rendezvous: dict[str, Any] | None = None  # adapters.rendezvous.Rendezvous.to_dict()
    fanout: int | None = None
    verify_layers: tuple[int, ...] | None = None
    plan_digest: str = ""
    lora_id: int | None = None
    math: dict[str, Any] | None = None  # layouts.math_config
    staging: str | None = None  # adapters.vllm.staging
    delta: int | None = None  # executors.delta.DeltaPolicy(keyframe_every=delta)

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
        if self.verify_layers is not None and not isinstance(self.verify_layers, (list, tuple)):
            problems.append(f"verify_layers={self.verify_layers!r} must be a list of layer numbers, or None")
        elif self.verify_layers is not None:
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
            from .rendezvous import Rendezvous

            Rendezvous.from_dict(self.rendezvous)

    # --- plain data ----------------------------------------------------------------------------------
    @classmethod
    def of(cls, spec: ModelSpec, src: Layout, dst: Layout, *, config: Any = None, **fields: Any) -> "RefitSpec":
        """The spec of a refit between two layouts of one model (the model is carried once, not in each layout).

        The fields of the model's HF config that change the math without changing shapes
        (`layouts.math_config.MATH_FIELDS`: MoE top-k, norm epsilon, rope, activation ...) travel as `math`, and
        every engine refuses a refit whose model's config sets any of them otherwise. They come from `config` when
        given, else from the spec itself (`spec.math`: a spec made by `ModelSpec.from_hf_config` carries them), so
        a refit from a spec read from a checkpoint is checked without further arguments. `math=None` turns the
        check off.

        Args:
            spec: the model.
            src: the trainer's layout.
            dst: the engine's layout (a registered layout that accepts the install).
            config: the trainer's HF config (a dict, config.json or checkpoint directory), for a spec that does
                not carry its math (one made field by field); it must be the spec's model's config (an adapter
                spec's: the config of the model it adapts).
            **fields: any other `RefitSpec` field (install, transport, options, fanout, math, ...).

        Returns:
            The spec.

        Raises:
            ArgumentError: an argument of the wrong kind, a config that is not the spec's model's, or both
                `config` and `math`.
            PlanError: a field `RefitSpec` refuses.
        """
        from pathlib import Path

        from ..arguments import instance

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
        if not isinstance(d, dict):
            raise PlanError(f"a refit spec must be a JSON object, got {type(d).__name__}")
        unknown = sorted(set(d) - set(_FIELDS))
        if unknown:
            raise PlanError(f"refit spec has unknown fields {unknown}; known: {sorted(_FIELDS)}")
        missing = sorted({"model", "src", "dst"} - set(d))
        if missing:
            raise PlanError(f"refit spec lacks {missing}")
        return cls(**d)

    def with_(self, **changes: Any) -> "RefitSpec":
        """A copy with `changes` (validated again)."""
        return replace(self, **changes)

    def with_expert_placement(self, placement: ExpertPlacement | None) -> "RefitSpec":
        """This refit for an EPLB engine whose experts now sit as `placement` says (read from the engine:
        `adapters.vllm.experts.live_placement`, or `ExpertPlacement.from_vllm` of its EPLB maps; None: vLLM's
        initial placement). The plan digest is cleared: init the refit again with this spec, and the plan is
        compiled for the new destination (the plan cache keeps the old one for the old placement). An engine
        refuses a plan of another placement than the one it holds, so a stale spec never writes a byte.

        Raises:
            ArgumentError: `placement` is not an ExpertPlacement (or None).
            LayoutError: the placement is not the engine's (other experts, EP size, MoE layers or redundancy), or
                the engine's layout has no expert parallelism.
        """
        from ..arguments import instance

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

    # --- what follows from it ------------------------------------------------------------------------
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
        """The plan's destination: the engine's layout (direct, lora_slot), or whole tensors per engine rank
        (loader)."""
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

    def binding(self) -> Binding:
        """Cross-process transports: trainer process p plays source rank p, process S + d destination rank d."""
        plan = self.plan()
        return Binding.disjoint(plan.src.num_ranks, plan.dst.num_ranks)

    @property
    def num_processes(self) -> int:
        """Cross-process transports: trainer processes + engine workers."""
        plan = self.plan()
        return plan.src.num_ranks + plan.dst.num_ranks


def _delta_problems(refit: RefitSpec) -> list[str]:
    """Why `refit.delta` (an int) cannot be carried: out of range, a plan with fan-out, an adapter slot (its install
    scales B in place: the slot no longer holds what landed) or a transport without it."""
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
    """The math fields of `config`, which must be the config of `spec`'s model (an adapter spec's: of the model it
    adapts): a config of another model would check the engine against the wrong math."""
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
    """This process's executor for the refit (trainer and worker side alike), over the transport the refit names
    (adapters.transports).

    Args:
        refit: the refit.
        process: this process's place in the refit (cross-process transports: see the module docstring).
        src, dst: this process's source / destination tensors (rank -> name -> tensor).
        store: the rendezvous's store (cross-process transports), already joined.
        group: the world group of the engine's workers ("colocated").

    Raises:
        ExecutionError: a cross-process transport without a rendezvous, or what the executor refuses.
    """
    from .rendezvous import Rendezvous

    from ..executors.delta import DeltaPolicy

    plan, options, chosen = refit.plan(), dict(refit.options), transports.transport(refit.transport)
    if refit.install == "loader" or refit.staging:  # buffers or staging, read only after a complete refit: in place
        options = {**chosen.in_place, **options}
    delta = None if refit.delta is None else DeltaPolicy(keyframe_every=refit.delta)
    if not chosen.cross_process:
        binding = Binding.colocated(plan.src.num_ranks, plan.dst.num_ranks)
        return transports.open_transport(refit.transport, transports.Endpoint(plan, binding, process, src, dst,
                                                                              options, group=group, delta=delta))
    if refit.rendezvous is None:
        raise ExecutionError(f"transport {refit.transport!r} needs a rendezvous (where the processes meet)")
    rdv = Rendezvous.from_dict(refit.rendezvous)
    options.setdefault("timeout", rdv.timeout)
    return transports.open_transport(refit.transport, transports.Endpoint(
        plan, refit.binding(), process, src, dst, options, store=store, rendezvous=rdv, delta=delta))


__all__ = ["RefitSpec", "open_transport"]
