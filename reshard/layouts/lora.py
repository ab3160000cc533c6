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
from typing import Any, Callable, Sequence

import numpy as np
from pydantic import StrictBool, StrictInt, model_validator

from ..errors import InputError, LayoutError
from .base import WholePerReplica, positive
from .cut_layout import CutLayout, Where
from .cuts import ColumnBlocks, Cut, Group, LoraA, LoraB, Refused, Replicated, RowBlocks, TensorKind
from .family import ModelFamily
from .model import LAYER, Entry, Experts, ModelSpec, Role
from .roles import Cuts, shared_kinds
from .vllm import VllmLayout

FAMILY = "lora"
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # Megatron-Bridge's target module names
PEFT_MODULES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
BASE_FAMILIES = ("qwen3", "llama", "qwen3_moe")  # GQA attention and SwiGLU MLP of the shared roles
PEFT_PREFIX = "base_model.model."
EXPERT_ADAPTERS = ("per_expert", "shared")  # one adapter per expert, or one for all (Bridge's default)


def lora_kind(label: str, megatron: Cuts, vllm_lora: Cuts, peft: Cuts, te: Cuts | None = None,
              expert: bool = False) -> TensorKind:
    """A kind of adapter tensor: its Megatron-Bridge, vLLM slot ("vllm_lora") and PEFT cuts."""
    return TensorKind(label, {"megatron": megatron, "te": megatron if te is None else te, "vllm_lora": vllm_lora,
                              "peft": peft}, expert=expert)


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


def _peft(module: str, ab: str, block: str = "") -> Replicated:
    block = block or ("self_attn." if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp.")
    return Replicated(f"{PEFT_PREFIX}{LAYER}{block}{module}.lora_{ab}.weight")


def _mlp_kinds(label: str, bridge: Callable[..., dict[str, Any]], slot: Callable[[str, str, int], str], block: str,
               expert: bool) -> dict[str, TensorKind]:
    """A SwiGLU MLP's adapter kinds: Megatron's cuts from `bridge(fc, in/out, cut, *args)`, vLLM's slots named
    `slot(fc, a/b, s)`, PEFT's names under `block`."""
    out = {"gate_up_proj.A": lora_kind(f"lora {label}gate_up A", vllm_lora=tuple(LoraA(slot("fc1", "a", s))
                                                                                for s in range(2)),
                                       peft=(_peft("gate_proj", "A", block), _peft("up_proj", "A", block)),
                                       expert=expert, **bridge("fc1", "in", RowBlocks))}
    for s, m in enumerate(("gate_proj", "up_proj")):
        out[f"{m}.B"] = lora_kind(f"lora {label}{m} B", vllm_lora=LoraB(slot("fc1", "b", s), rows=RowBlocks("rows")),
                                  peft=_peft(m, "B", block), expert=expert, **bridge("fc1", "out", RowBlocks, s, 2))
    out["down_proj.A"] = lora_kind(f"lora {label}down_proj A", vllm_lora=LoraA(slot("fc2", "a", 0), split_input=True),
                                   peft=_peft("down_proj", "A", block), expert=expert,
                                   **bridge("fc2", "in", ColumnBlocks))
    out["down_proj.B"] = lora_kind(f"lora {label}down_proj B", vllm_lora=LoraB(slot("fc2", "b", 0)),
                                   peft=_peft("down_proj", "B", block), expert=expert,
                                   **bridge("fc2", "out", RowBlocks))
    return out


@functools.lru_cache(maxsize=64)
def lora_kinds(heads: int, groups: int, head_dim: int) -> dict[str, TensorKind]:
    """Each adapter tensor's kind, by canonical module and A/B ("qkv_proj.A", "q_proj.B", ...)."""
    base = shared_kinds(heads, groups, head_dim, False)
    qkv, attn = ("q_proj", "k_proj", "v_proj"), "self_attention.linear_{}.adapter.linear_{}.weight"
    slot = "self_attn.{}_proj.lora_{}_stacked.{}"
    out = {"qkv_proj.A": lora_kind("lora qkv A", RowBlocks(attn.format("qkv", "in")),
                                   tuple(LoraA(LAYER + slot.format("qkv", "a", s)) for s in range(3)),
                                   peft=tuple(_peft(m, "A") for m in qkv)),
           "o_proj.A": lora_kind("lora o_proj A", ColumnBlocks(attn.format("proj", "in")),
                                 LoraA(LAYER + slot.format("o", "a", 0), split_input=True), peft=_peft("o_proj", "A")),
           "o_proj.B": lora_kind("lora o_proj B", RowBlocks(attn.format("proj", "out")),
                                 LoraB(LAYER + slot.format("o", "b", 0)), peft=_peft("o_proj", "B"))}
    for s, (role, m) in enumerate(zip((Role.Q, Role.K, Role.V), qkv)):
        rows = dataclasses.replace(base[role].cuts_for("vllm")[0], alone=True)
        out[f"{m}.B"] = lora_kind(f"lora {m} B", dataclasses.replace(base[role].cuts_for("megatron")[0],
                                                                      name=attn.format("qkv", "out")),
                                  LoraB(LAYER + slot.format("qkv", "b", s), rows=rows), peft=_peft(m, "B"))

    def bridge(fc: str, which: str, cut: type[Cut], *args: int) -> dict[str, Any]:
        return {"megatron": cut(f"mlp.linear_{fc}.adapter.linear_{which}.weight", *args)}

    def mlp_slot(fc: str, ab: str, s: int) -> str:
        return f"{LAYER}mlp.{'gate_up_proj' if fc == 'fc1' else 'down_proj'}.lora_{ab}_stacked.{s}"

    return {**out, **_mlp_kinds("", bridge, mlp_slot, "", False)}


@functools.lru_cache(maxsize=16)
def shared_expert_lora_kinds(experts: int) -> dict[str, TensorKind]:
    """The kinds of one adapter shared by a layer's `experts` (TEGroupedMLP's), copied per expert."""
    local = Refused("", reason="a shared expert adapter lives on TEGroupedMLP; SequentialMLP (naming 'local') "
                    "adapts each expert", fix="declare naming='te', or build the spec with "
                    "expert_adapters='per_expert'")
    out = {}
    for key, kind in expert_lora_kinds().items():
        te = tuple(dataclasses.replace(c, stacked=False) for c in kind.cuts_for("te"))  # one 2D adapter, not a stack
        per_expert = {engine: tuple(dataclasses.replace(c, expert=e) for c in kind.cuts_for(engine)
                                    for e in range(experts)) for engine in ("vllm_lora", "peft")}
        out[key] = dataclasses.replace(kind.with_cuts(megatron=(local,), te=te, **per_expert),
                                       label=kind.label.replace("expert", "shared expert"))
    return out


@functools.lru_cache(maxsize=1)
def expert_lora_kinds() -> dict[str, TensorKind]:
    """Each per-expert adapter tensor's kind ("gate_up_proj.A", ...): a dense MLP's, per expert."""
    def bridge(fc: str, which: str, cut: type[Cut], *args: int) -> dict[str, Any]:
        adapter = f"linear_{fc}.adapter.linear_{which}.weight"
        return {"megatron": (cut(f"mlp.experts.local_experts.{{j}}.{adapter}", *args),),
                "te": (cut(f"mlp.experts.{adapter}", *args, stacked=True),)}

    def slot(fc: str, ab: str, s: int) -> str:
        return f"{LAYER}mlp.experts.{'w13' if fc == 'fc1' else 'w2'}_lora_{ab}_stacked.{s}"

    return _mlp_kinds("expert ", bridge, slot, "mlp.experts.{e}.", True)


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

    def layer(self, spec: ModelSpec, i: int) -> list[Entry]:
        f = lora_facts(spec)
        k = lora_kinds(spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim)
        H, r, d, m = spec.hidden_size, f.rank, spec.head_dim, LAYER + "mlp."
        q, kv = spec.num_attention_heads * d, spec.num_key_value_heads * d
        out: list[Entry | Experts] = _adapter_entries(LAYER + "self_attn.", k, f.targets, {
            "linear_qkv": (("qkv_proj", "A", (r, H)), ("q_proj", "B", (q, r)), ("k_proj", "B", (kv, r)),
                           ("v_proj", "B", (kv, r))),
            "linear_proj": (("o_proj", "A", (r, q)), ("o_proj", "B", (H, r)))})
        if not spec.is_moe_layer(i):
            return out + _mlp_entries(m, k, H, r, spec.intermediate_size, f.targets)
        Fm = spec.moe_intermediate_size
        if f.experts == "shared":  # one adapter for all experts: the per-expert shapes, no expert number
            return out + _mlp_entries(m + "experts.", shared_expert_lora_kinds(spec.num_experts), H, r, Fm, f.targets)
        # per expert, expert by expert (the per-expert checkpoint order)
        entries = _mlp_entries(m + "experts.{e}.", expert_lora_kinds(), H, r, Fm, f.targets)
        return out + ([Experts(tuple(entries), spec.num_experts)] if entries else [])


def _mlp_entries(prefix: str, k: dict[str, TensorKind], H: int, r: int, F: int,
                 targets: tuple[str, ...]) -> list[Entry]:
    """A SwiGLU MLP's adapter tensors under `prefix` (a dense MLP, one expert's, or one shared by all experts)."""
    return _adapter_entries(prefix, k, targets, {
        "linear_fc1": (("gate_up_proj", "A", (r, H)), ("gate_proj", "B", (F, r)), ("up_proj", "B", (F, r))),
        "linear_fc2": (("down_proj", "A", (r, F)), ("down_proj", "B", (H, r)))})


def _adapter_entries(prefix: str, k: dict[str, TensorKind], targets: tuple[str, ...],
                     parts: dict[str, tuple[tuple[str, str, tuple[int, int]], ...]]) -> list[Entry]:
    """`prefix` + `<module>.lora_<A|B>.weight` of each (module, A/B, shape) of the targeted Megatron modules."""
    return [Entry(f"{prefix}{m}.lora_{ab}.weight", shape, k[f"{m}.{ab}"])
            for target, adapters in parts.items() if target in targets for m, ab, shape in adapters]


def _adapter_cuts(engine: str, kind: TensorKind) -> tuple[Cut, ...]:
    cuts = kind.cuts_for(engine)
    if cuts is None:
        raise LayoutError(engine, f"{kind.label} is not a LoRA adapter tensor: this layout places adapters only",
                          {"model.family": kind.label}, "build the model with reshard.layouts.lora.lora_spec")
    return cuts


class PeftLayout(WholePerReplica, CutLayout):
    """A PEFT adapter directory's tensors: each whole under its PEFT name on each replica's rank."""

    engine = "peft"

    replicas: StrictInt = 1

    @model_validator(mode="after")
    def _validate(self) -> "PeftLayout":
        lora_facts(self.model)
        self._check_replicas()
        self._check_cuts()
        return self

    def _cuts(self, kind: TensorKind) -> tuple[Cut, ...]:
        return _adapter_cuts(self.engine, kind)

    def _place(self, cut: Cut, kind: TensorKind, layer: np.ndarray | int, expert: np.ndarray | int,
               replica: int | None) -> Where | None:
        copies = tuple(range(self.replicas)) if replica is None else (replica,)
        expert = expert if cut.expert is None else cut.expert  # a shared adapter's copy for expert cut.expert
        return Where(Group(self.engine, 1, 1, copies), 0, (layer, expert), lambda i, e: cut.name.format(i=i, e=e))


class VllmLoraLayout(VllmLayout):
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

    def _cuts(self, kind: TensorKind) -> tuple[Cut, ...]:
        return _adapter_cuts(self.engine, kind)


__all__ = ["BASE_FAMILIES", "EXPERT_ADAPTERS", "LoraFacts", "LoraFamily", "PEFT_MODULES", "PeftLayout",
           "TARGETS", "VllmLoraLayout", "base_spec", "lora_facts", "lora_kind", "lora_kinds", "lora_spec",
           "peft_config"]
