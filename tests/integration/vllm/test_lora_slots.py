"""vLLM 0.33's LoRA slots, at TP1 and TP2 (gloo), with and without fully_sharded_loras, a KV head replicated over
TP2, and max_lora_rank above the adapter's rank: an adapter refit by reshard from Megatron-Bridge shards into the
slot of a loaded adapter holds, buffer for buffer and byte for byte, what vLLM's own loader and set_lora put in
the slot of the adapter `peft` saved from the same values (lora_slot_checks.py runs in the session's world of each
TP size: conftest.py's vllm_worlds)."""
from __future__ import annotations

import os
import subprocess

import pytest

from vllm_harness import ROOT

pytestmark = pytest.mark.vllm
CORE_PYTHON = ROOT / ".venv/bin/python"  # has peft; the vLLM virtualenv does not
RANK, ALPHA, TRAINER_TP = 8, 12, 2
CASES = {1: [("qwen3", 16, False)],  # at TP1 fully_sharded_loras cuts nothing
         2: [("qwen3", 16, False), ("qwen3", 8, True), ("qwen3_mqa", 8, False), ("qwen3_moe", 8, False)]}
TARGETS = {"qwen3_moe": ["linear_qkv", "linear_proj"]}  # no FusedMoEWithLoRA on CPU: attention only
ALL = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
BUFFERS = {"linear_qkv": 6, "linear_proj": 2, "linear_fc1": 4, "linear_fc2": 2}  # per layer, A and B per slice
MAKE = """
import sys, torch
from safetensors.torch import save_file
import reshard
from reshard.layouts.lora import lora_spec
from harness.lora import adapter_weights, save_with_peft
from reshard.layouts.lora import lora_facts
rank, alpha = int(sys.argv[1]), float(sys.argv[2])
for job in sys.argv[3:]:  # ckpt,out,targets (targets joined by +)
    ckpt, out, targets = job.split(",")
    base = reshard.ModelSpec.from_hf_config(ckpt).model_copy(update={"dtype": "float32"})
    spec = lora_spec(base, rank, alpha, targets.split("+"))
    modules = list(lora_facts(spec).peft_modules)
    weights = adapter_weights(spec, 7)
    save_file(weights, out + "/weights.safetensors")
    save_with_peft(ckpt, weights, rank, alpha, modules, out + "/peft")
    save_with_peft(ckpt, adapter_weights(spec, 8), rank, alpha, modules, out + "/other")
"""


def world_jobs(selected, checkpoints, out):
    """This module's cases for the session's worlds (conftest.vllm_worlds), per world the selected ones; the
    adapters they load saved first with peft (those cases' checkpoints' only)."""
    if not CORE_PYTHON.exists():
        pytest.skip("no core virtualenv (.venv) to save the adapter with peft")
    cases = {world: [(n, R, s) for n, R, s in CASES[world] if _name(n, R, s) in selected[world]] for world in selected}
    adapters = {name: out / name for name in sorted({c[0] for cs in cases.values() for c in cs})}
    for path in adapters.values():
        path.mkdir(parents=True)
    subprocess.run([str(CORE_PYTHON), "-c", MAKE, str(RANK), str(ALPHA),
                    *(f"{checkpoints[n]},{p},{'+'.join(TARGETS.get(n, ALL))}" for n, p in adapters.items())],
                   check=True, cwd=str(ROOT), env={"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "PATH": "/usr/bin:/bin"},
                   capture_output=True, timeout=300)
    return {world: [{"name": _name(n, R, s), "ckpt": str(checkpoints[n]),
                     "peft": str(adapters[n] / "peft"), "other": str(adapters[n] / "other"),
                     "weights": str(adapters[n] / "weights.safetensors"), "rank": RANK, "alpha": ALPHA,
                     "trainer_tp": TRAINER_TP, "max_lora_rank": R, "fully_sharded": s,
                     "targets": TARGETS.get(n, ALL),
                     # the CUDA wheel's expert LoRA layer cannot be built on CPU: the engine adapts attention
                     "engine_targets": ["qkv_proj", "o_proj"] if n in TARGETS else None}
                    for n, R, s in cs]
            for world, cs in cases.items()}


def _name(checkpoint: str, max_lora_rank: int, fully_sharded: bool) -> str:
    return f"{checkpoint}-R{max_lora_rank}-{'sharded' if fully_sharded else 'plain'}"


@pytest.mark.parametrize("world,case", [(w, _name(*c)) for w, cs in CASES.items() for c in cs])
def test_refit_slot_equals_vllm_loaded_peft_adapter(reports, world, case):
    for rank, report in enumerate(reports[world]):
        r = report[case]
        assert "setup" not in r, r.get("setup")
        name = case.split("-")[0]
        want = 2 * sum(BUFFERS[t] for t in TARGETS.get(name, ALL))  # two layers
        assert r["buffers"] == want and r["differ"] == [] and r["changed"], (rank, r)
        sharded = "sharded" in case and world > 1
        assert any(("Sharded" in k) == sharded for k in r["kinds"]), r["kinds"]
