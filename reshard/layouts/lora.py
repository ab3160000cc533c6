"""LoRA adapters as models: an adapter's tensors are the canonical tensors of a spec of family "lora", so layouts,
the compiler, the proofs and every executor take an adapter as they take a model; only the cuts are new
(`cuts.LoraA`, `cuts.LoraB`, `QkvParallel(alone=True)`).

Canonical tensors (under `model.layers.{i}.`): one A per adapted (possibly fused) linear layer and one B per
output part: `self_attn.qkv_proj.lora_A` with `{q,k,v}_proj.lora_B`, `o_proj.lora_A/B`, `mlp.gate_up_proj.lora_A`
with `{gate,up}_proj.lora_B`, `down_proj.lora_A/B`. MoE experts are adapted per expert (under `mlp.experts.{e}.`,
Megatron-Bridge's `share_expert_adapters=False`) or by one adapter shared by all experts (under `mlp.experts.`,
Bridge's default), of which vLLM's slots and a PEFT file hold a copy per expert.

Source side: Megatron-Bridge's PEFT LoRA (`megatron.bridge.peft.lora.LoRA`, NVIDIA-NeMo/Megatron-Bridge 067f987):
`<module>.adapter.linear_in.weight` (A) / `linear_out.weight` (B) of linear_qkv, linear_proj, linear_fc1 and
linear_fc2. A column-parallel base cuts A on its rank dim and B like the base weight; a row-parallel base cuts A
into column blocks and B into row blocks. Experts: the same cuts over expert TP on the expert's EP rank
(SequentialMLP's per-local-expert names, or TEGroupedMLP's stack over local experts on dim 0).

Destinations: vLLM's LoRA slots (`VllmLoraLayout`: `<module>.lora_{a,b}_stacked.{s}`, one adapter slot's view,
padded to max_lora_rank; experts `mlp.experts.w13/w2_lora_{a,b}_stacked.{s}` stacked like w13 / w2) and a PEFT
directory (`PeftLayout`: `base_model.model.<module>.lora_{A,B}.weight`, whole, one rank per replica)."""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
from pydantic import StrictBool, StrictInt, model_validator

from ..errors import InputError, LayoutError
from .base import WholePerReplica, positive
from .cut_layout import CutLayout, Where
from .cuts import ColumnBlocks, Cut, Group, LoraA, LoraB, QkvParallel, Refused, Replicated, RowBlocks, TensorKind
from .family import ModelFamily
from .model import LAYER, Entry, Experts, ModelSpec, Role
from .roles import shared_kinds
from .vllm import VllmLayout

FAMILY = "lora"
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # Megatron-Bridge's target module names
PEFT_MODULES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
BASE_FAMILIES = ("qwen3", "llama", "qwen3_moe")  # GQA attention and SwiGLU MLP of the shared roles
PEFT_PREFIX = "base_model.model."
EXPERT_ADAPTERS = ("per_expert", "shared")  # one adapter per expert, or one for all (Bridge's default)
# Megatron-Bridge's target -> the fused HF module, its label in reports, its parts' base roles, its HF block
_MODULES = {"linear_qkv": ("qkv_proj", "qkv", (Role.Q, Role.K, Role.V), "self_attn."),
            "linear_proj": ("o_proj", "o_proj", (Role.O,), "self_attn."),
            "linear_fc1": ("gate_up_proj", "gate_up", (Role.GATE, Role.UP), "mlp."),
            "linear_fc2": ("down_proj", "down_proj", (Role.DOWN,), "mlp.")}
_EXPERT_ROLES = {Role.GATE: Role.EXPERT_GATE, Role.UP: Role.EXPERT_UP, Role.DOWN: Role.EXPERT_DOWN}


@dataclass(frozen=True)
class LoraFacts:
    """What a LoRA spec adds to its base model: the base family, rank r, alpha, the adapted Megatron modules."""

    base: str
    rank: int
    alpha: float
    targets: tuple[str, ...]
    experts: str = ""  # "per_expert" or "shared" where a MoE layer's experts are adapted, else ""

    @property
    def scaling(self) -> float:
        """What vLLM and PEFT multiply B A by (vLLM folds it into its B slots when it loads an adapter)."""
        return self.alpha / self.rank

    @property
    def peft_modules(self) -> tuple[str, ...]:
        """The PEFT module names the adapted Megatron modules stand for."""
        return tuple(m for t in self.targets for m in PEFT_MODULES[t])


def lora_spec(base: ModelSpec, rank: int, alpha: float, targets: Sequence[str] = TARGETS,
              expert_adapters: str = "per_expert") -> ModelSpec:
    """The adapter of rank `rank` and scale `alpha` on `targets` (Megatron-Bridge module names) of `base`, as a
    spec of family "lora" (a MoE base's experts adapted as `expert_adapters` says); InputError naming what is not
    supported."""
    if base.family not in BASE_FAMILIES:
        raise InputError("base.family", base.family, f"is not supported by LoRA refits (supported: "
                         f"{', '.join(BASE_FAMILIES)})", where="lora")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InputError("rank", rank, "must be a positive integer", where="lora")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise InputError("alpha", alpha, "must be a positive finite number", where="lora")
    targets = tuple(targets)
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets or len(set(targets)) != len(targets):
        rule = f"must name each of some of {list(TARGETS)} once" + (f" (unsupported: {unknown})" if unknown else "")
        raise InputError("targets", list(targets), rule, where="lora",
                         fix="Megatron-Bridge's LoRA targets that vLLM's LoRA layers for Qwen3 / Llama cover")
    experts = base.is_moe and bool({"linear_fc1", "linear_fc2"} & set(targets))
    if experts and expert_adapters not in EXPERT_ADAPTERS:
        raise InputError("expert_adapters", expert_adapters, f"is not one of {list(EXPERT_ADAPTERS)}", where="lora",
                         fix="per_expert: Megatron-Bridge's share_expert_adapters=False; shared: its default")
    targets = tuple(t for t in TARGETS if t in targets)  # one order: the spec (and its digest) is canonical
    data = base.model_dump()
    arch = dict(base.arch)
    arch.update(lora_base=base.family, lora_rank=rank, lora_alpha=alpha, lora_targets=targets)
    if experts:  # only then: a dense adapter's spec (and digest) is what it was
        arch.update(lora_experts=expert_adapters)
    data.update(family=FAMILY, arch=arch)
    return ModelSpec(**data)


def lora_facts(spec: ModelSpec) -> LoraFacts:
    """The facts of a LoRA adapter spec (`lora_spec`); InputError for any other spec."""
    if spec.family != FAMILY:
        raise InputError("model.family", spec.family, "is not a LoRA adapter spec (build one with "
                         "reshard.layouts.lora.lora_spec)", where="lora")
    return LoraFacts(spec.arch_value("lora_base"), spec.arch_value("lora_rank"), spec.arch_value("lora_alpha"),
                     tuple(spec.arch_value("lora_targets")), spec.arch_value("lora_experts", ""))


def base_spec(spec: ModelSpec) -> ModelSpec:
    """The model an adapter spec adapts."""
    facts = lora_facts(spec)
    data = spec.model_dump()
    data.update(family=facts.base, arch={k: v for k, v in spec.arch if not k.startswith("lora_")})
    return ModelSpec(**data)


def peft_config(spec: ModelSpec, base_model: str = "") -> dict[str, Any]:
    """adapter_config.json of the adapter, as PEFT writes it for a plain LoRA (the keys vLLM's PEFTHelper reads)."""
    f = lora_facts(spec)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model or None,
            "r": f.rank, "lora_alpha": f.alpha, "target_modules": sorted(f.peft_modules), "lora_dropout": 0.0,
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "modules_to_save": None, "inference_mode": True}


def _bridge(cut: Cut, which: str, like: bool) -> Cut:
    """Megatron-Bridge's adapter `linear_{which}` of the base weight `cut` places: cut like it (`like`), else in TP
    row blocks; TE's per-expert weights `...weight{j}` hold one adapter stacked over the local experts."""
    name = cut.name.removesuffix("{j}").removesuffix("weight") + f"adapter.linear_{which}.weight"
    stacked = cut.name.endswith("{j}")
    return dataclasses.replace(cut, name=name, stacked=stacked) if like else RowBlocks(name, stacked=stacked)


def _slot(cut: Cut, ab: str, s: int) -> str:
    """vLLM's LoRA slot s of the base weight `cut` names (`qkv_proj.weight` -> `qkv_proj.lora_a_stacked.0`, an
    expert stack's `routed_experts.w13_weight` -> `w13_lora_a_stacked.0`)."""
    return cut.name.replace("routed_experts.", "").removesuffix("weight") + f"lora_{ab}_stacked.{s}"


def _adapter_kinds(base: Mapping[Role, TensorKind], targets: Sequence[str], expert: bool) -> dict[str, TensorKind]:
    """The kinds of the adapters of `targets`, each cut as its base layer's weights (`base`) are: a row-parallel
    base (Megatron's column blocks) cuts A like itself and B into row blocks, a column-parallel one A into row
    blocks (its rank dim) and each part's B like the part; `expert`: a routed expert's MLP (HF's `experts.{e}.`)."""
    out = {}
    for target in targets:
        fused, label, roles, block = _MODULES[target]
        parts = [base[_EXPERT_ROLES[r] if expert else r] for r in roles]
        bridge = {e: [k.cuts_for(e)[0] for k in parts] for e in ("megatron", "te")}
        vllm = [k.cuts_for("vllm")[0] for k in parts]
        row_parallel = isinstance(bridge["megatron"][0], ColumnBlocks)
        block, tag = (block + "experts.{e}.", "expert ") if expert else (block, "")

        def peft(module: str, ab: str) -> Replicated:
            return Replicated(f"{PEFT_PREFIX}{LAYER}{block}{module}.lora_{ab}.weight")

        out[f"{fused}.A"] = TensorKind(f"lora {tag}{label} A", {
            **{e: _bridge(cuts[0], "in", row_parallel) for e, cuts in bridge.items()},
            "vllm_lora": tuple(LoraA(_slot(vllm[0], "a", s), split_input=row_parallel) for s in range(len(parts))),
            "peft": tuple(peft(m, "A") for m in PEFT_MODULES[target])}, expert=expert)
        for s, m in enumerate(PEFT_MODULES[target]):
            # B of one part stands alone in its slot: vLLM cuts its rows as the base cuts that part's
            rows = None if row_parallel else (dataclasses.replace(vllm[s], alone=True)
                                              if isinstance(vllm[s], QkvParallel) else RowBlocks("rows"))
            out[f"{m}.B"] = TensorKind(f"lora {tag}{m} B", {
                **{e: _bridge(cuts[s], "out", not row_parallel) for e, cuts in bridge.items()},
                "vllm_lora": LoraB(_slot(vllm[0], "b", s), rows=rows), "peft": peft(m, "B")}, expert=expert)
    return out


@functools.lru_cache(maxsize=64)
def lora_kinds(heads: int, groups: int, head_dim: int, expert: bool = False) -> dict[str, TensorKind]:
    """Each adapter tensor's kind, by canonical module and A/B ("qkv_proj.A", "q_proj.B", ...); `expert`: the MLP
    adapters of one routed expert."""
    return _adapter_kinds(shared_kinds(heads, groups, head_dim, False), TARGETS[2:] if expert else TARGETS, expert)


@functools.lru_cache(maxsize=16)
def shared_expert_lora_kinds(experts: int, heads: int, groups: int, head_dim: int) -> dict[str, TensorKind]:
    """The kinds of one adapter shared by a layer's `experts` (TEGroupedMLP's), copied per expert."""
    local = Refused("", reason="a shared expert adapter lives on TEGroupedMLP; SequentialMLP (naming 'local') "
                    "adapts each expert", fix="declare naming='te', or build the spec with "
                    "expert_adapters='per_expert'")
    out = {}
    for key, kind in lora_kinds(heads, groups, head_dim, True).items():
        te = tuple(dataclasses.replace(c, stacked=False) for c in kind.cuts_for("te"))  # one 2D adapter, not a stack
        per_expert = {engine: tuple(dataclasses.replace(c, expert=e) for c in kind.cuts_for(engine)
                                    for e in range(experts)) for engine in ("vllm_lora", "peft")}
        out[key] = dataclasses.replace(kind.with_cuts(megatron=(local,), te=te, **per_expert),
                                       label=kind.label.replace("expert", "shared expert"))
    return out


class LoraFamily(ModelFamily):
    """The tensors of a LoRA adapter (see the module docstring); specs come from `lora_spec`, never a config."""

    name = FAMILY
    architectures = ()

    def spec(self, config: dict[str, Any], include_mtp: bool = False) -> ModelSpec:
        raise InputError("config", rule="cannot describe a LoRA adapter: build its spec with "
                         "reshard.layouts.lora.lora_spec(base, rank, alpha, targets)", where="lora")

    def head(self, spec: ModelSpec) -> list[Entry]:
        return []

    def tail(self, spec: ModelSpec) -> list[Entry]:
        return []

    def layer(self, spec: ModelSpec, i: int) -> list[Entry | Experts]:
        f, sizes = lora_facts(spec), (spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim)
        H, q, kv, m = spec.hidden_size, sizes[0] * sizes[2], sizes[1] * sizes[2], LAYER + "mlp."
        mlp = lambda F: {"linear_fc1": (H, (F, F)), "linear_fc2": (F, (H,))}  # noqa: E731  target -> (in, outs)
        out = _entries(LAYER + "self_attn.", lora_kinds(*sizes), f, {"linear_qkv": (H, (q, kv, kv)),
                                                                     "linear_proj": (q, (H,))})
        if not spec.is_moe_layer(i):
            return out + _entries(m, lora_kinds(*sizes), f, mlp(spec.intermediate_size))
        Fm = spec.moe_intermediate_size
        if f.experts == "shared":  # one adapter for all experts: the per-expert shapes, no expert number
            return out + _entries(m + "experts.", shared_expert_lora_kinds(spec.num_experts, *sizes), f, mlp(Fm))
        # per expert, expert by expert (the per-expert checkpoint order)
        entries = _entries(m + "experts.{e}.", lora_kinds(*sizes, True), f, mlp(Fm))
        return out + ([Experts(tuple(entries), spec.num_experts)] if entries else [])


def _entries(prefix: str, k: dict[str, TensorKind], facts: LoraFacts,
             sizes: dict[str, tuple[int, tuple[int, ...]]]) -> list[Entry | Experts]:
    """`prefix` + `<module>.lora_<A|B>.weight` of the targeted modules of `sizes` (target -> (in, each part's out)):
    the fused module's A [r, in], then each part's B [out, r]."""
    out: list[Entry | Experts] = []
    for target, (cols, rows) in sizes.items():
        if target in facts.targets:
            fused, r = _MODULES[target][0], facts.rank
            out.append(Entry(f"{prefix}{fused}.lora_A.weight", (r, cols), k[f"{fused}.A"]))
            out += [Entry(f"{prefix}{m}.lora_B.weight", (n, r), k[f"{m}.B"])
                    for m, n in zip(PEFT_MODULES[target], rows)]
    return out


class _AdapterCuts:
    """A layout of adapters only: each tensor by its kind's cuts for this engine; any other tensor is refused."""

    def _cuts(self, kind: TensorKind) -> tuple[Cut, ...]:
        cuts = kind.cuts_for(self.engine)
        if cuts is None:
            raise LayoutError(self.engine, f"{kind.label} is not a LoRA adapter tensor: this layout places adapters "
                              f"only", {"model.family": kind.label},
                              "build the model with reshard.layouts.lora.lora_spec")
        return cuts


class PeftLayout(_AdapterCuts, WholePerReplica, CutLayout):
    """A PEFT adapter directory's tensors: each whole under its PEFT name on each replica's rank."""

    engine = "peft"

    replicas: StrictInt = 1

    @model_validator(mode="after")
    def _validate(self) -> "PeftLayout":
        lora_facts(self.model)
        self._check_replicas()
        self._check_cuts()
        return self

    def _place(self, cut: Cut, kind: TensorKind, layer: np.ndarray | int, expert: np.ndarray | int,
               replica: int | None) -> Where | None:
        copies = tuple(range(self.replicas)) if replica is None else (replica,)
        expert = expert if cut.expert is None else cut.expert  # a shared adapter's copy for expert cut.expert
        return Where(Group(self.engine, 1, 1, copies), 0, (layer, expert), lambda i, e: cut.name.format(i=i, e=e))


class VllmLoraLayout(_AdapterCuts, VllmLayout):
    """vLLM's LoRA slots of one adapter on each rank: per adapted module and slice s, `lora_a_stacked.{s}`
    [max_lora_rank, in] and `lora_b_stacked.{s}` [out_s, max_lora_rank] -- the views `[slot, 0]` of vLLM's
    buffers; rows / columns r.. are padding. `fully_sharded`: vLLM's fully_sharded_loras (S-LoRA cuts)."""

    engine = "vllm_lora"
    installs = ("lora_slot",)

    max_lora_rank: StrictInt = 16
    fully_sharded: StrictBool = False

    @model_validator(mode="after")
    def _validate_lora(self) -> "VllmLoraLayout":
        facts = lora_facts(self.model)
        r = facts.rank
        positive(self, max_lora_rank=self.max_lora_rank)  # r > max_lora_rank: the cuts refuse it (cuts.LoraA)
        if facts.experts and self.fully_sharded and self.expert_parallel:  # FusedMoEWithLoRA refuses it too
            self._fail("vLLM does not run expert LoRA with both expert parallelism and fully_sharded_loras",
                       "turn one of them off", expert_parallel=True, fully_sharded=True)
        if facts.experts and self.fully_sharded and r % self.tp:  # FusedMoEWithLoRA._slice_w13_a asserts it
            self._fail(f"fully sharded expert LoRA needs the adapter's rank r={r} divisible by tp={self.tp}",
                       "train a rank divisible by tp, or turn fully_sharded off", rank=r, tp=self.tp)
        if self.redundant_experts or self.expert_placement is not None:  # not declared: vLLM's slots per expert
            self._fail("LoRA slots of an EPLB engine (redundant experts, a placement) are not declared",
                       redundant_experts=self.redundant_experts)
        return self

    def expert_stacks(self, replica: int = 0) -> None:
        """Adapter slots hold no expert weights: nothing for the EPLB slot proof."""
        return None

    def __str__(self) -> str:
        sharded = ",fully_sharded" if self.fully_sharded else ""
        return f"vllm_lora:tp={self.tp},replicas={self.replicas},max_lora_rank={self.max_lora_rank}{sharded}"

    def _group(self, expert: bool, replica: int | None) -> Group:
        return dataclasses.replace(super()._group(expert, replica), lora_rank=self.max_lora_rank,
                                   lora_sharded=self.fully_sharded)


__all__ = ["BASE_FAMILIES", "EXPERT_ADAPTERS", "LoraFacts", "LoraFamily", "PEFT_MODULES", "PeftLayout",
           "TARGETS", "VllmLoraLayout", "base_spec", "lora_facts", "lora_kinds", "lora_spec",
           "peft_config"]
