"""What is where: model specs and the layouts of each side. Imports nothing from the rest of reshard.

The modules, each importing only those listed before it:
  registry     families by name and HF architecture; layouts by engine; an added engine's cuts per family;
               reading an HF config
  model        ModelSpec (a model's facts), Role, and the canonical tensors (TensorSpec; the CanonicalTable built
               from a family's `Entry` lists)
  base         Placement, PlacementTable / TableBuilder, the Layout base class
  cuts         the one vocabulary of cuts (Replicated, RowBlocks, ColumnBlocks, Vocab, ...) and TensorKind (a
               kind of tensor: its cuts on each engine, by the engine's name)
  roles        the shared roles as Kinds
  cut_layout   a layout that places every tensor by its kind's cuts (or its engine's registered ones)
  expert_placement      ExpertPlacement: which logical expert each physical slot of an EPLB engine holds
  megatron, vllm, hf    the built-in engines' layouts; spec_string: layouts as strings and JSON
  family       ModelFamily, the base class of a family file
  fp8          FP8 block-scaled destinations: the scheme, the wire spec (fp8 + scales), their cuts; lists its
               entries through the registry's entry transforms
  lora         LoRA adapters as models (family "lora"), the PEFT and vLLM-slot layouts
  families/    one file per family; BUILT_IN_FAMILIES lists them
Nothing registers itself: the package calls `families.register_built_ins()` (the built-in families and FP8's entry
transform) and `register_built_in_layouts()` once, below; `register_family(cls)` adds a family defined elsewhere,
`register_layout(cls)` a layout (a new engine: a refit destination where its `installs` say so) and
`register_cuts(engine, family, rule)` that engine's cuts for a family.
"""
from .base import Layout, Placement
from .expert_placement import ExpertPlacement
from .families import (ModelFamily, discover, read_hf_config, register_built_ins, register_family,
                       registered_families, spec_from_hf_config, supported_architectures)
from .hf import HfLayout
from .megatron import MegatronLayout
from .model import ModelSpec, Role, TensorSpec
from .registry import register_cuts, register_layout, registered_layouts
from .spec_string import layout_from_dict, layout_to_dict, parse_layout, register_built_in_layouts
from .vllm import VllmLayout

register_built_ins()
register_built_in_layouts()

__all__ = [
    "ExpertPlacement", "HfLayout", "Layout", "MegatronLayout", "ModelFamily", "ModelSpec", "Placement", "Role",
    "TensorSpec", "VllmLayout", "discover", "layout_from_dict", "layout_to_dict", "parse_layout", "read_hf_config",
    "register_cuts", "register_family", "register_layout", "registered_families", "registered_layouts",
    "spec_from_hf_config", "supported_architectures",
]
