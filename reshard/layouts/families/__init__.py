"""The built-in model families, one file each, listed in BUILT_IN_FAMILIES (docs: "Add a model family")."""
from __future__ import annotations

from typing import Any

from ...errors import ArgumentError
from ..family import ModelFamily, attention_layer, dense_mlp, gqa_attention, norm, routed_experts
from ..fp8 import transform_items
from ..base import Layout
from ..hf import HfLayout
from ..lora import LoraFamily, PeftLayout, VllmLoraLayout
from ..megatron import MegatronLayout
from ..registry import (discover, family, read_hf_config, register, register_entry_transform, register_layout,
                        registered_families, spec_from_hf_config, supported_architectures)
from ..vllm import VllmLayout
from .deepseek_v3 import DeepseekV3
from .llama import Llama
from .qwen3 import Qwen3
from .qwen3_5 import Qwen35
from .qwen3_moe import Qwen3Moe

# every family the library knows without being told (LoRA adapters are a family of their own: layouts.lora)
BUILT_IN_FAMILIES: tuple[type[ModelFamily], ...] = (Qwen3, Qwen3Moe, Llama, Qwen35, DeepseekV3, LoraFamily)
# every layout nameable by its engine without being told (layouts.spec_string reads them by engine name)
BUILT_IN_LAYOUTS: tuple[type[Layout], ...] = (MegatronLayout, VllmLayout, HfLayout, PeftLayout, VllmLoraLayout)


def register_family(cls: Any) -> Any:
    """Register the model family class `cls` (a ModelFamily subclass) and return it (usable as a decorator).

    Args:
        cls: the family's class; it is instantiated once.

    Returns:
        `cls`, unchanged.

    Raises:
        ArgumentError: `cls` is not a concrete ModelFamily subclass.
    """
    if not (isinstance(cls, type) and issubclass(cls, ModelFamily)) or getattr(cls, "__abstractmethods__", None):
        raise ArgumentError("cls", cls, "must be a concrete ModelFamily subclass (spec and layer defined)")
    register(cls())
    return cls


def register_built_ins() -> None:
    """Register every family of BUILT_IN_FAMILIES, every layout of BUILT_IN_LAYOUTS and FP8's entry transform
    (layouts.fp8); the package calls it once (`reshard.layouts`)."""
    for cls in BUILT_IN_FAMILIES:
        register_family(cls)
    for layout in BUILT_IN_LAYOUTS:
        register_layout(layout)
    register_entry_transform(transform_items)

__all__ = ["BUILT_IN_FAMILIES", "BUILT_IN_LAYOUTS", "ModelFamily", "attention_layer", "dense_mlp", "discover",
           "family", "gqa_attention", "norm", "read_hf_config", "register_built_ins", "register_family",
           "registered_families", "routed_experts", "spec_from_hf_config", "supported_architectures"]
