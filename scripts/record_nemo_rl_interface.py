"""Record NeMo-RL's checkpoint-engine interface as data (tests/data/nemo_rl_checkpoint_engine.json), read from a
NeMo-RL checkout with `ast` (nothing of NeMo-RL is imported or copied): the methods of
nemo_rl/utils/checkpoint_engines/base.py's `CheckpointEngine` (parameters, their kinds, async or not, abstract or
not), its class attributes, the keys of `VllmWeightLayout` and the fields of the plugin config NeMo-RL passes as
keyword arguments. tests/unit/test_nemo_rl_contract.py compares ReshardCheckpointEngine against it.

`config` records how NeMo-RL turns a user's YAML into the engine's constructor call, so a config block of the docs
can be run through the same steps (tests/integration/nemo_rl/test_guide_configs.py): the plugin config's schema
(`VllmCheckpointEnginePluginConfig`: fields, types, defaults, constraints, whether extra keys are allowed), the
fields excluded from the keyword arguments (the `model_dump(exclude=...)` of checkpoint_engine_config.py), the
mebibyte the bucket size is rounded to (the synchronizer's `_MEBIBYTE`), all parsed; and the checks NeMo-RL makes on
the generation config before it builds a checkpoint engine, read (listed in CONFIG_CHECKS, with where they are).

    python scripts/record_nemo_rl_interface.py /path/to/NeMo-RL [--out tests/data/nemo_rl_checkpoint_engine.json]
"""
from __future__ import annotations

import argparse
import ast
import json
import subprocess
from pathlib import Path

BASE = "nemo_rl/utils/checkpoint_engines/base.py"
LAYOUT = "nemo_rl/models/generation/vllm/refit_layout.py"
CONFIG = "nemo_rl/models/generation/vllm/config.py"
# How NeMo-RL drives an engine (nemo_rl/weight_sync/checkpoint_engine_weight_synchronizer.py, the policy worker's
# PolicyCheckpointEngineMixin and vLLM's VllmCheckpointEngineMixin at the recorded commit); read, not parsed.
CALL_ORDER = [
    {"step": "construct", "where": "policy and vLLM workers", "call": "create_checkpoint_engine(backend, "
     "bucket_size_bytes=..., engine_kwargs=...) -> cls(bucket_size=bucket_size_bytes, **engine_kwargs)"},
    {"step": "prepare", "where": "every engine", "call": "prepare(); dict results get 'rank' added; policy results "
     "sorted by rank first, then vLLM workers' in global rollout order"},
    {"step": "init", "where": "all together", "call": "init_policy_process_group(worker_rank=..., "
     "train_world_size=..., rollout_world_size=..., metadata=...) / init_rollout_process_group(rollout_rank=..., "
     "...)"},
    {"step": "refit", "where": "all together, per refit", "call": "policy: await send_weights(iterator) where the "
     "Megatron worker filters the iterator with get_target_weight_layout(); vLLM: async for batch in "
     "receive_weight_batches(): load_weights(batch)"},
    {"step": "finalize", "where": "every engine", "call": "finalize() at shutdown, or after every refit when "
     "release_after_refit; the next refit prepares and inits again (the engine objects are kept)"},
]
KINDS = {"posonlyargs": "POSITIONAL_ONLY", "args": "POSITIONAL_OR_KEYWORD", "kwonlyargs": "KEYWORD_ONLY"}
ENGINE_CONFIG = "nemo_rl/weight_sync/checkpoint_engine_config.py"
SYNCHRONIZER = "nemo_rl/weight_sync/checkpoint_engine_weight_synchronizer.py"
# What NeMo-RL checks of `policy.generation` before a custom checkpoint engine is built; read, not parsed.
CONFIG_CHECKS = [
    {"key": "backend", "equals": "vllm", "where": "weight_sync/factory.py create_weight_synchronizer; "
     "algorithms/grpo.py (any refit_transport needs the vLLM backend)"},
    {"key": "colocated.enabled", "equals": False, "where": "weight_sync/factory.py (checkpoint-engine refit is "
     "non-colocated only)"},
    {"key": "refit_transport", "contains": ":", "where": "models/generation/vllm/config.py "
     "normalize_vllm_refit_config (a 'module:ClassName' path; anything else must be a built-in name)"},
    {"key": "refit_cfg[refit_transport]", "required": True, "where": "normalize_vllm_refit_config (validated by "
     "the plugin config; checkpoint_engine_refit_config dumps it as the engine's keyword arguments)"},
]
BUCKET_RULE = ("bucket_size = the smallest total GPU memory among the policy and vLLM workers times "
               "update_weights_bucket_memory_ratio, rounded down to a whole unit; less than one unit is refused "
               "(CheckpointEngineWeightSynchronizer._resolve_bucket_size_bytes)")


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _method(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> dict:
    params = []
    for group, kind in KINDS.items():
        for a in getattr(fn.args, group):
            params.append({"name": a.arg, "kind": kind})
    defaults = [None] * (len(fn.args.posonlyargs) + len(fn.args.args) - len(fn.args.defaults)) + fn.args.defaults
    for p, d in zip(params, defaults + [*fn.args.kw_defaults]):
        p["has_default"] = d is not None
    yields = any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in ast.walk(fn))
    returns = ast.unparse(fn.returns) if fn.returns is not None else None
    return {"params": params[1:],  # without self
            "async": isinstance(fn, ast.AsyncFunctionDef) and not yields,
            "async_iterable": (returns or "").startswith("AsyncGenerator"),
            "abstract": any(ast.unparse(d) in ("abstractmethod", "abc.abstractmethod") for d in fn.decorator_list),
            "returns": returns}


def _constant(node: ast.expr) -> object:
    """A module constant written as arithmetic on literals (e.g. `1024 * 1024`)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Pow, ast.Add)):
        left, right = _constant(node.left), _constant(node.right)
        return {ast.Mult: left * right, ast.Pow: left ** right, ast.Add: left + right}[type(node.op)]
    return ast.literal_eval(node)


def _field(annotation: ast.expr, value: ast.expr | None) -> dict:
    """A pydantic field: its type, default and constraints (`Annotated[T, Field(gt=..., lt=...)]`)."""
    constraints: dict = {}
    if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) == "Annotated":
        base, *metadata = annotation.slice.elts
        for m in metadata:
            if isinstance(m, ast.Call) and ast.unparse(m.func) == "Field":
                constraints.update({k.arg: ast.literal_eval(k.value) for k in m.keywords})
        annotation = base
    default = ast.literal_eval(value) if value is not None and not isinstance(value, ast.Call) else None
    return {"type": ast.unparse(annotation), "default": default, "constraints": constraints}


def _model(tree: ast.Module, name: str) -> dict:
    """A pydantic model's schema: its class keywords (extra=...) and its annotated fields."""
    cls = _class(tree, name)
    return {"class": name, "extra": next((ast.literal_eval(k.value) for k in cls.keywords if k.arg == "extra"), None),
            "fields": {t.target.id: _field(t.annotation, t.value) for t in cls.body if isinstance(t, ast.AnnAssign)}}


def _dump_exclude(tree: ast.Module) -> list[str]:
    """The fields `model_dump(exclude=...)` leaves out of the engine's keyword arguments."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "model_dump":
            for k in node.keywords:
                if k.arg == "exclude":
                    return sorted(ast.literal_eval(k.value))
    raise ValueError("no model_dump(exclude=...) call found")


def _config(root: Path) -> dict:
    config = ast.parse((root / CONFIG).read_text())
    synchronizer = ast.parse((root / SYNCHRONIZER).read_text())
    unit = next(_constant(n.value) for n in synchronizer.body if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "_MEBIBYTE" for t in n.targets))
    return {"plugin_config": _model(config, "VllmCheckpointEnginePluginConfig"),
            "refit_config": _model(config, "VllmRefitConfig"),
            "engine_kwargs_exclude": _dump_exclude(ast.parse((root / ENGINE_CONFIG).read_text())),
            "bucket_size": {"unit": unit, "rule": BUCKET_RULE},
            "checks": CONFIG_CHECKS}


def record(root: Path) -> dict:
    base = ast.parse((root / BASE).read_text())
    engine = _class(base, "CheckpointEngine")
    methods = {fn.name: _method(fn) for fn in engine.body if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))}
    attributes = {t.target.id: {"annotation": ast.unparse(t.annotation), "default": ast.literal_eval(t.value)}
                  for t in engine.body if isinstance(t, ast.AnnAssign) and isinstance(t.target, ast.Name)}
    layout = ast.parse((root / LAYOUT).read_text())
    typed = {c: [t.target.id for t in _class(layout, c).body if isinstance(t, ast.AnnAssign)]
             for c in ("VllmWeightLayout", "VllmExpertParamLayout")}
    config = ast.parse((root / CONFIG).read_text())
    plugin = [t.target.id for t in _class(config, "VllmCheckpointEnginePluginConfig").body
              if isinstance(t, ast.AnnAssign)]
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return {
        "source": {"repository": "https://github.com/NVIDIA-NeMo/RL", "commit": commit,
                   "files": [BASE, LAYOUT, CONFIG, ENGINE_CONFIG, SYNCHRONIZER]},
        "constructor": {"keywords": ["bucket_size"], "plus": "the refit_cfg entry of the class path, as keywords",
                        "plugin_config_fields": plugin, "excluded_from_kwargs": ["update_weights_bucket_memory_ratio"]},
        "call_order": CALL_ORDER,
        "methods": methods,
        "attributes": attributes,
        "typed_dicts": typed,
        "config": _config(root),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkout")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1]
                                        / "tests/data/nemo_rl_checkpoint_engine.json"))
    a = p.parse_args()
    Path(a.out).write_text(json.dumps(record(Path(a.checkout)), indent=2) + "\n")


if __name__ == "__main__":
    main()
