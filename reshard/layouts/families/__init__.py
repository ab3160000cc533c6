"""The built-in model families, one file each, listed in BUILT_IN_FAMILIES: adding one = adding its file and its
line there (docs: "Add a model family"). The registry registers the list on its first look-up (layouts.registry).

Architecture discovery reads `architectures` and then `model_type`; an unknown one gets an error that lists
the supported ones.
"""
from __future__ import annotations

from ..family import ModelFamily, attention_layer, dense_mlp, gqa_attention, norm, routed_experts
from ..lora import LoraFamily
from ..registry import (discover, family, read_hf_config, register_family, registered_families, spec_from_hf_config,
                        supported_architectures)
from .deepseek_v3 import DeepseekV3
from .llama import Llama
from .qwen3 import Qwen3
from .qwen3_5 import Qwen35
from .qwen3_moe import Qwen3Moe

# every family the library knows without being told (LoRA adapters are a family of their own: layouts.lora)
BUILT_IN_FAMILIES: tuple[type[ModelFamily], ...] = (Qwen3, Qwen3Moe, Llama, Qwen35, DeepseekV3, LoraFamily)

__all__ = ["BUILT_IN_FAMILIES", "ModelFamily", "attention_layer", "dense_mlp", "discover", "family", "gqa_attention", "norm",
           "read_hf_config", "register_family", "registered_families", "routed_experts", "spec_from_hf_config",
           "supported_architectures"]
