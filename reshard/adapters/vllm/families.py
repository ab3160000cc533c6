"""vLLM model families: what reshard needs to know about a vLLM model class beyond `VllmLayout`. A class named like
an architecture of a registered `ModelFamily` is served from that family; `register_family` describes any other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...errors import LayoutError
from ...layouts import discover, supported_architectures


@dataclass(frozen=True)
class VllmFamily:
    """How a vLLM model class maps to a reshard family (`register_vllm_family`)."""

    architecture: str  # the vLLM model class name, as in an HF config's `architectures`
    spec_family: str  # the reshard ModelSpec family it serves
    # Live parameters that hold no model weights (formatted with the layer index `{i}`); buffers such as
    # attention scales, rotary caches and `_expert_map` are not parameters and need no entry.
    not_weights: tuple[str, ...] = ()


_FAMILIES: dict[str, VllmFamily] = {}


def register_family(family: VllmFamily) -> VllmFamily:
    """Register the facts of a vLLM model class (refused if another description of it is registered); returns it."""
    if family.architecture in _FAMILIES and _FAMILIES[family.architecture] != family:
        raise LayoutError("vllm", f"a different description of {family.architecture} is already registered")
    _FAMILIES[family.architecture] = family
    return family


def family_of(model: Any) -> VllmFamily:
    """The description of a live vLLM model (looked up by its class), or an error listing those supported."""
    name = type(model).__name__
    if name not in _FAMILIES and name in supported_architectures():
        spec_family = discover({"architectures": [name]})
        return register_family(VllmFamily(name, spec_family.name, spec_family.vllm_not_weights))
    if name not in _FAMILIES:
        raise LayoutError("vllm", f"vLLM model class {name} has no reshard description; supported: "
                                  f"{', '.join(sorted({*_FAMILIES, *supported_architectures()}))}",
                          {"model_class": name}, "add a model family (README: Add a model family)")
    return _FAMILIES[name]
