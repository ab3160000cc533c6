"""The built-in model families, one file each. Every module of this package is imported with it, and a family
registers itself when its class is defined: adding one = adding its file (README: "Add a model family").

Architecture discovery reads `architectures` and then `model_type`; an unknown one gets an error that lists
the supported ones.
"""
from __future__ import annotations

import importlib
import pkgutil

from ..family import ModelFamily, attention_layer, dense_mlp, gqa_attention, norm, routed_experts
from ..registry import (discover, family, read_hf_config, registered_families, spec_from_hf_config,
                        supported_architectures)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["ModelFamily", "attention_layer", "dense_mlp", "discover", "family", "gqa_attention", "norm",
           "read_hf_config", "registered_families", "routed_experts", "spec_from_hf_config",
           "supported_architectures"]
