"""Which of megatron-core's two parameter naming schemes a model uses.

- "local" (`get_gpt_layer_local_spec`): separate norms `input_layernorm.weight`, `pre_mlp_layernorm.weight`;
  experts `mlp.experts.local_experts.{j}.linear_fc1.weight` (SequentialMLP).
- "te" (`get_gpt_layer_with_transformer_engine_spec`): norms fused into the next linear,
  `self_attention.linear_qkv.layer_norm_weight` and (dense layers) `mlp.linear_fc1.layer_norm_weight`; MoE layers
  keep a separate `pre_mlp_layernorm.weight`; grouped experts `mlp.experts.linear_fc1.weight{j}` (TEGroupedMLP).

Two expert variants are refused because the layout does not describe them: TE layers with SequentialMLP experts
(`moe_grouped_gemm=False`) and the legacy fused GroupedMLP (`mlp.experts.weight1` / `weight2`).
"""
from __future__ import annotations

import re
from typing import Iterable, Literal

from ...errors import LayoutError

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
