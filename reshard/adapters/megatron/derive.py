"""Derive the MegatronLayout a live model is in from its ModelFacts: parallel sizes and rank numbering from its
process groups, pipeline split and vocabulary padding from its config, and the naming scheme from its parameter
names: "local" (separate norms, SequentialMLP experts `local_experts.{j}`) or "te" (norms fused into the next
linear, TEGroupedMLP experts `linear_fc1.weight{j}`); other expert variants are refused.
"""
from __future__ import annotations

import itertools
import re
from typing import Any, Iterable, Literal

from ...errors import LayoutError
from ...layouts import MegatronLayout, ModelSpec
from ...layouts.base import pad_to
from .model import ParallelState, read_model

DEFAULT_ORDER = "tp-cp-ep-dp-pp"  # megatron-core's initialize_model_parallel default
MEGATRON_LM_VOCAB_DIVISOR = 128  # Megatron-LM's make_vocab_size_divisible_by default
Naming = Literal["local", "te"]

# A name ending that only one scheme produces: the attention input norm.
_MARKERS: dict[Naming, str] = {"te": ".self_attention.linear_qkv.layer_norm_weight",
                               "local": ".input_layernorm.weight"}
# Expert parameter names each scheme produces (with Megatron-Bridge's LoRA adapters of those linears: per local
# expert, or one grouped / shared adapter of TEGroupedMLP's); anything else under mlp.experts is refused.
_ADAPTER = r"adapter\.linear_(?:in|out)\.weight"
_EXPERTS: dict[Naming, re.Pattern[str]] = {
    "local": re.compile(rf"\.mlp\.experts\.local_experts\.\d+\.linear_fc[12]\.(?:weight|{_ADAPTER})$"),
    "te": re.compile(rf"\.mlp\.experts\.linear_fc[12]\.(?:weight\d+|{_ADAPTER})$"),
}


def derive_layout(model: Any, spec: ModelSpec, *, like: MegatronLayout | None = None) -> MegatronLayout:
    """The layout of `model` (a GPTModel, its chunks, or its ModelFacts) for `spec`, `like`'s where equivalent."""
    facts = read_model(model)
    cfg = facts.config.transformer
    unsupported = [f for f in ("pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
                               "account_for_loss_in_pipeline_split") if getattr(cfg, f, None)]
    if unsupported:
        raise LayoutError("megatron", f"pipeline split by {unsupported} is not described by the Megatron layout",
                          fix="use even stages or num_layers_in_first/last_pipeline_stage")
    return layout_from_facts(spec, facts.parallel_state, names=facts.parameters, vpp=facts.vpp,
                             padded_vocab=facts.config.padded_vocab,
                             first_stage_layers=cfg.num_layers_in_first_pipeline_stage,
                             last_stage_layers=cfg.num_layers_in_last_pipeline_stage, like=like)


def layout_from_facts(spec: ModelSpec, parallel: ParallelState, *, names: Iterable[str], vpp: int,
                      padded_vocab: int, first_stage_layers: int | None = None, last_stage_layers: int | None = None,
                      like: MegatronLayout | None = None) -> MegatronLayout:
    """`derive_layout` from facts already read; LayoutError when no rank order numbers the groups as `parallel` has."""
    tp, pp = parallel.size("tp"), parallel.size("pp")
    ep, etp = (parallel.size("ep"), parallel.size("etp")) if spec.is_moe else (1, tp)  # dense: expert groups unused
    fields = dict(model=spec, tp=tp, pp=pp, ep=ep, etp=etp, world=parallel.world, vpp=vpp,
                  first_stage_layers=first_stage_layers if pp > 1 else None,
                  last_stage_layers=last_stage_layers if pp > 1 else None,
                  vocab_divisor=vocab_divisor(spec.vocab_size, padded_vocab, tp, like),
                  naming=naming_of(names))
    orders = [like.rank_order] if like is not None else []
    orders += [DEFAULT_ORDER] + ["-".join(p) for p in itertools.permutations(DEFAULT_ORDER.split("-"))]
    for order in dict.fromkeys(orders):  # first consistent order wins; keeps the preference order
        layout = MegatronLayout(**fields, rank_order=order)
        if _numbering_matches(layout, parallel):
            return layout
    raise LayoutError("megatron", f"no rank order of {DEFAULT_ORDER} numbers rank {parallel.rank}'s process groups "
                      f"as megatron-core did ({dict(parallel.groups)})",
                      fix="ranks offset from 0 (non-colocated trainers) are not described by the layout")


def vocab_divisor(vocab: int, padded: int, tp: int, like: MegatronLayout | None = None) -> int:
    """A divisor d with pad_to(vocab, d * tp) == padded: `like`'s if it fits, else 128, else the smallest."""
    candidates = ([like.vocab_divisor] if like is not None else []) + [MEGATRON_LM_VOCAB_DIVISOR]
    if padded % tp == 0:
        candidates += range(1, padded // tp + 1)
    for d in candidates:
        if pad_to(vocab, d * tp) == padded:
            return d
    raise LayoutError("megatron", f"the model's vocabulary of {padded} rows is not the spec's {vocab} padded to a "
                      f"multiple of tp={tp} times any divisor", values={"padded": padded, "vocab": vocab, "tp": tp})


def _numbering_matches(layout: MegatronLayout, parallel: ParallelState) -> bool:
    """Each member of each of this rank's groups has, on that group's axis, its index in the group."""
    axes = [("tp", "tp", layout.dense_coords), ("dp", "dp", layout.dense_coords), ("pp", "pp", layout.dense_coords)]
    if layout.model.is_moe:
        axes += [("etp", "tp", layout.expert_coords), ("ep", "ep", layout.expert_coords),
                 ("edp", "dp", layout.expert_coords)]
    return all(member < layout.num_ranks and coords(member)[axis] == i
               for group_name, axis, coords in axes for i, member in enumerate(parallel.groups[group_name]))


def naming_of(names: Iterable[str]) -> Naming:
    """The scheme of a model (or one rank's chunks) from its parameter names; refuses mixtures and unknowns."""
    names = list(names)
    found = [scheme for scheme, end in _MARKERS.items() if any(n.endswith(end) for n in names)]
    if len(found) != 1:
        what = "both" if found else "neither"
        raise LayoutError("megatron", f"cannot tell the naming scheme: the parameters have {what} of "
                          f"{' and '.join(repr(m.lstrip('.')) for m in _MARKERS.values())}",
                          values={"example_names": names[:5]})
    scheme = found[0]
    odd = [n for n in names if ".mlp.experts." in n and not _EXPERTS[scheme].search(n)]
    if odd:
        raise LayoutError("megatron", f"expert parameters {odd[:3]} are not named as the {scheme!r} scheme names "
                          f"experts ({_EXPERTS[scheme].pattern})",
                          fix="use SequentialMLP experts with the local spec, or TEGroupedMLP "
                              "(moe_grouped_gemm=True) with the TransformerEngine spec")
    return scheme
