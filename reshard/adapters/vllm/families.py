"""vLLM model families: what reshard needs to know about one vLLM model class beyond `VllmLayout`.

A vLLM model class named like an architecture of a `ModelSpec` family in reshard.layouts.families is served
without an entry here; one is needed only for parameters that hold no weights. Otherwise supporting a new vLLM
model class costs one `VllmFamily(...)` line here (plus its `ModelSpec` family in reshard.layouts.families and, if its parameters are named or stacked differently, the rules in
reshard.layouts.vllm). Everything else -- parameter names, shapes, where each loader puts each canonical
element -- is read off the live model and checked against the declared layout (see `check`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...errors import LayoutError


@dataclass(frozen=True)
class VllmFamily:
    architecture: str  # the vLLM model class name, as in an HF config's `architectures`
    spec_family: str  # the reshard ModelSpec family it serves
    # Live parameters that hold no model weights (formatted with the layer index `{i}`); buffers such as
    # attention scales, rotary caches and `_expert_map` are not parameters and need no entry.
    not_weights: tuple[str, ...] = ()


_FAMILIES: dict[str, VllmFamily] = {}


def register_family(family: VllmFamily) -> VllmFamily:
    if family.architecture in _FAMILIES and _FAMILIES[family.architecture] != family:
        raise LayoutError("vllm", f"a different description of {family.architecture} is already registered")
    _FAMILIES[family.architecture] = family
    return family


QWEN3 = register_family(VllmFamily("Qwen3ForCausalLM", "qwen3"))
QWEN3_MOE = register_family(VllmFamily("Qwen3MoeForCausalLM", "qwen3_moe"))
LLAMA = register_family(VllmFamily("LlamaForCausalLM", "llama"))


def family_of(model: Any) -> VllmFamily:
    """The description of a live vLLM model (looked up by its class), or an error listing those supported."""
    name = type(model).__name__
    if name not in _FAMILIES:
        # A vLLM class named like an architecture a reshard family declares, with no entry here, needs none
        # (no parameter that is not a weight): the family gets the vLLM adapter without a line here.
        from ...layouts.families import _FAMILIES as SPEC_FAMILIES

        if name in SPEC_FAMILIES:
            return register_family(VllmFamily(name, SPEC_FAMILIES[name].name))
    if name not in _FAMILIES:
        raise LayoutError("vllm", f"vLLM model class {name} has no reshard description; supported: "
                                  f"{', '.join(sorted(_FAMILIES))}",
                          {"model_class": name}, "add a VllmFamily in reshard/adapters/vllm/families.py")
    return _FAMILIES[name]
