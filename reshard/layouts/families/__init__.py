"""The built-in model families, one file each, listed in BUILT_IN_FAMILIES (docs: "Add a model family")."""
from __future__ import annotations

from ..base import Layout
from ..family import ModelFamily
from ..fp8 import transform_items
from ..hf import HfLayout
from ..lora import LoraFamily, PeftLayout, VllmLoraLayout
from ..megatron import MegatronLayout
from ..registry import (discover, family, read_hf_config, register_entry_transform, register_family, register_layout,
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


def register_built_ins() -> None:
    """Register every family of BUILT_IN_FAMILIES, every layout of BUILT_IN_LAYOUTS and FP8's entry transform
    (layouts.fp8); the package calls it once (`reshard.layouts`)."""
    for cls in BUILT_IN_FAMILIES:
        register_family(cls)
    for layout in BUILT_IN_LAYOUTS:
        register_layout(layout)
    register_entry_transform(transform_items)

__all__ = ["BUILT_IN_FAMILIES", "BUILT_IN_LAYOUTS", "ModelFamily", "discover", "family", "read_hf_config",
           "register_built_ins", "register_family", "registered_families", "spec_from_hf_config",
           "supported_architectures"]
