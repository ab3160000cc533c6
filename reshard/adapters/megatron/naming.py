"""Which of megatron-core's parameter naming schemes a model uses: "local" (separate norms, SequentialMLP experts
`local_experts.{j}`) or "te" (norms fused into the next linear, TEGroupedMLP experts `linear_fc1.weight{j}`).
Other expert variants are refused.
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
