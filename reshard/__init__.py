"""reshard: declare where a model's bytes live on each side, compile a verified plan, run it.

    import reshard
    spec = reshard.ModelSpec.from_hf_config("examples/configs/qwen3-30b-a3b.json")
    plan = reshard.compile(reshard.MegatronLayout(model=spec, tp=2, ep=8, etp=1, world=16),
                           reshard.VllmLayout(model=spec, tp=4, replicas=4))
    print(plan)

Heavy dependencies (torch for executors, megatron-core, vllm, nixl for adapters) are imported only by the
modules that need them.
"""
from .errors import (ArgumentError, CoverageError, ExecutionError, InputError, KernelFormatError, LayoutError,
                     LayoutMismatchError, LimitError, ModelConfigError, PlanError, PlanFileError, ReshardError)
from .layouts import (ExpertPlacement, HfLayout, Layout, MegatronLayout, ModelSpec, Placement, Role, TensorSpec,
                      VllmLayout, parse_layout)
from .planner import Plan, compile, compile_plan

__version__ = "0.1.0"

__all__ = [
    "ArgumentError", "CoverageError", "ExecutionError", "ExpertPlacement", "HfLayout", "InputError", "KernelFormatError",
    "Layout", "LayoutError", "LayoutMismatchError", "LimitError", "MegatronLayout", "ModelConfigError", "ModelSpec",
    "Placement", "Plan", "PlanError", "PlanFileError", "ReshardError", "Role", "TensorSpec", "VllmLayout", "compile",
    "compile_plan", "parse_layout",
]
