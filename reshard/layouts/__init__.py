"""What is where: model specs and the layouts of each side. Imports nothing from the rest of reshard."""
from .base import Layout, Placement
from .families import ModelFamily, discover, registered_families, spec_from_hf_config, supported_architectures
from .hf import HfLayout
from .megatron import MegatronLayout
from .model import ModelSpec, Role, TensorSpec
from .spec_string import LAYOUT_KINDS, layout_from_dict, layout_to_dict, parse_layout
from .vllm import VllmLayout

__all__ = [
    "HfLayout", "LAYOUT_KINDS", "Layout", "MegatronLayout", "ModelFamily", "ModelSpec", "Placement", "Role",
    "TensorSpec", "VllmLayout", "layout_from_dict", "layout_to_dict", "parse_layout", "spec_from_hf_config",
    "supported_architectures",
]
