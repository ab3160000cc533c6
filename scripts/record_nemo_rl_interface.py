"""Record NeMo-RL's checkpoint-engine interface as data (tests/data/nemo_rl_checkpoint_engine.json), read from a
NeMo-RL checkout with `ast` (nothing of NeMo-RL is imported or copied): the methods of
nemo_rl/utils/checkpoint_engines/base.py's `CheckpointEngine` (parameters, their kinds, async or not, abstract or
not), its class attributes, the keys of `VllmWeightLayout` and the fields of the plugin config NeMo-RL passes as
keyword arguments. tests/unit/test_nemo_rl_contract.py compares ReshardCheckpointEngine against it.

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
                   "files": [BASE, LAYOUT, CONFIG]},
        "constructor": {"keywords": ["bucket_size"], "plus": "the refit_cfg entry of the class path, as keywords",
                        "plugin_config_fields": plugin, "excluded_from_kwargs": ["update_weights_bucket_memory_ratio"]},
        "call_order": CALL_ORDER,
        "methods": methods,
        "attributes": attributes,
        "typed_dicts": typed,
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
