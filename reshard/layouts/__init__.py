"""What is where: model specs and the layouts of each side. Imports nothing from the rest of reshard.

Modules, each importing only those before it: registry (families, layouts, added engines' cuts), model
(ModelSpec, Role, canonical tensors), base (Placement, Layout), cuts (Replicated, RowBlocks, ... and TensorKind),
roles (the shared roles' kinds), cut_layout, expert_placement, megatron / vllm / hf (the built-in layouts),
spec_string (layouts as strings and JSON), family (ModelFamily), fp8, lora, families/ (one file per family).
Nothing registers itself: the package calls `register_built_ins()` below (families and layouts);
`register_family`, `register_layout` and `register_cuts` add a family, a layout or an engine's cuts."""
from .base import Layout, Placement
from .expert_placement import ExpertPlacement
from .families import (ModelFamily, discover, read_hf_config, register_built_ins, register_family,
                       registered_families, spec_from_hf_config, supported_architectures)
from .hf import HfLayout
from .megatron import MegatronLayout
from .model import ModelSpec, Role, TensorSpec
from .registry import register_cuts, register_layout, registered_layouts
from .spec_string import layout_from_dict, layout_to_dict, parse_layout
from .vllm import VllmLayout

register_built_ins()

__all__ = [
    "ExpertPlacement", "HfLayout", "Layout", "MegatronLayout", "ModelFamily", "ModelSpec", "Placement", "Role",
    "TensorSpec", "VllmLayout", "discover", "layout_from_dict", "layout_to_dict", "parse_layout", "read_hf_config",
    "register_cuts", "register_family", "register_layout", "registered_families", "registered_layouts",
    "spec_from_hf_config", "supported_architectures",
]
