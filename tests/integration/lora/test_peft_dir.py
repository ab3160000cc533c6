"""Landing (b): a Megatron-Bridge adapter refit into a PEFT directory equals the adapter `peft` saves itself from
the same values -- the same tensors under the same names, and PEFT's own loader gives the same logits -- and the
directory is switched atomically."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

import reshard
from reshard.adapters.lora import PeftDirectory
from reshard.errors import ArgumentError, ExecutionError
from reshard.executors import execute_local, shard
from reshard.layouts.lora import PeftLayout, lora_spec
from harness.lora import adapter_weights, save_with_peft
from reshard.testing.megatron_cpu import TinyGPT
from harness.serve_jobs import make_checkpoint

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(TinyGPT(num_layers=2), tmp_path_factory.mktemp("ckpt") / "base", seed=0)


def _refit(spec, weights, directory: PeftDirectory, tp: int = 2, pp: int = 2) -> None:
    src = reshard.MegatronLayout(model=spec, tp=tp, pp=pp, world=tp * pp * 2)  # dp=2
    execute_local(reshard.compile(src, directory.layout), shard(src, weights), {0: directory.tensors})


def test_written_directory_equals_peft_saved_adapter(checkpoint, tmp_path):
    spec = lora_spec(TinyGPT(num_layers=2).spec(), 8, 16)
    weights = adapter_weights(spec, seed=3)
    theirs = save_with_peft(checkpoint, weights, 8, 16, MODULES, tmp_path / "peft")
    directory = PeftDirectory(tmp_path / "served", PeftLayout(model=spec), base_model=str(checkpoint))
    _refit(spec, weights, directory)
    ours = directory.publish("step-1")
    a, b = load_file(str(ours / "adapter_model.safetensors")), load_file(str(theirs / "adapter_model.safetensors"))
    assert sorted(a) == sorted(b) and len(a) == 2 * 2 * len(MODULES)
    for name in b:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    mine, peft_cfg = (json.loads((d / "adapter_config.json").read_text()) for d in (ours, theirs))
    for key in ("r", "lora_alpha", "peft_type", "use_rslora", "use_dora", "bias", "fan_in_fan_out"):
        assert mine[key] == peft_cfg[key], key
    assert sorted(mine["target_modules"]) == sorted(peft_cfg["target_modules"])

    # PEFT's own loader, on the served path: the same logits as peft's adapter, different from the base model's
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tokens = torch.tensor([[1, 5, 9, 13, 2]])
    logits = []
    for d in (directory.path, theirs):
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32),
                                          str(d))
        with torch.no_grad():
            logits.append(model(tokens).logits)
    base = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    with torch.no_grad():
        plain = base(tokens).logits
    assert torch.equal(logits[0], logits[1])
    assert not torch.allclose(logits[0], plain, atol=1e-3)


def test_publish_switches_atomically_and_refuses_bad_input(tmp_path):
    spec = lora_spec(TinyGPT(num_layers=2).spec(), 4, 8, ["linear_qkv", "linear_proj"])
    directory = PeftDirectory(tmp_path / "served", PeftLayout(model=spec))
    assert directory.current() is None
    _refit(spec, adapter_weights(spec, 1), directory)
    first = directory.publish("v1")
    assert os.path.realpath(directory.path) == str(first)
    _refit(spec, adapter_weights(spec, 2), directory)
    second = directory.publish("v2")
    assert os.path.realpath(directory.path) == str(second) and not first.exists()
    served = load_file(str(directory.path / "adapter_model.safetensors"))
    assert all(torch.equal(served[n], t) for n, t in directory.tensors.items())
    # a bad publish leaves v2 served, and nothing half-written next to it
    directory.tensors.pop(next(iter(directory.tensors)))
    with pytest.raises(ExecutionError, match="do not match"):
        directory.publish("v3")
    with pytest.raises(ArgumentError, match="version"):
        directory.publish("../x")
    assert os.path.realpath(directory.path) == str(second)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["served", second.name])
    (tmp_path / "plain").mkdir()
    with pytest.raises(ArgumentError, match="not a link"):
        PeftDirectory(tmp_path / "plain", PeftLayout(model=spec))
