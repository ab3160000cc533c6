"""The dry run in the exact form the README and the core issue give."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import reshard
from reshard.cli import main

ISSUE_FORM = ["plan", "--model", "examples/configs/qwen3-235b-a22b.json",
              "--src", "megatron:tp=4,pp=8,ep=16,etp=1,world=128,first_stage_layers=11,last_stage_layers=11",
              "--dst", "vllm:tp=8,replicas=8"]


def test_235b_dry_run_json(capsys):
    assert main(ISSUE_FORM + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["coverage"] == "exact"
    assert out["total_bytes"] == out["lower_bound_bytes"] > 0
    assert out["gather_broadcast_bytes"] > out["total_bytes"]
    assert len(out["egress_bytes"]) == 128 and len(out["ingress_bytes"]) == 64
    assert sum(out["ingress_bytes"]) == out["total_bytes"]
    assert out["num_ops"] > 0 and out["compile_seconds"] > 0
    # Each of 8 replicas receives the model once (bf16, padding excluded), plus what vLLM TP8 replicates:
    # each of the 4 KV heads sits on 2 ranks; norms and the router sit on all 8.
    t, g, d, H, E, L = 8, 4, 128, 4096, 128, 94
    per_layer = (t // g - 1) * 2 * g * d * H + (t - 1) * (2 * H + 2 * d + E * H)
    per_replica = out["model_bytes"] + 2 * (L * per_layer + (t - 1) * H)
    assert out["total_bytes"] == 8 * per_replica


def test_readme_dry_run_prints_summary():
    cmd = [sys.executable, "-m", "reshard.cli", "plan", "--model", "examples/configs/qwen3-30b-a3b.json",
           "--src", "megatron:tp=2,pp=2,ep=8,etp=1,world=16", "--dst", "vllm:tp=2,replicas=8"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    for words in ("coverage     exact", "lower bound", "gather+bcast", "egress by source rank", "compile"):
        assert words in out


@pytest.mark.parametrize("args,words", [
    (["--src", "megatron:tp=3"], "num_attention_heads=32 is not divisible by tp=3"),
    (["--src", "megatron:tp=2,bogus=1"], "unknown option 'bogus'"),
    (["--src", "deepspeed:tp=2"], "unknown layout engine 'deepspeed'"),
    (["--src", "megatron:tp=2", "--colocated", "1,x"], "--colocated='1,x' must list whole numbers, comma-separated"),
    (["--src", "megatron:tp=2", "--colocated", "0,5"], "--colocated='0,5' lists [5] outside [0, 2)"),
])
def test_bad_layouts_exit_2_with_the_reason(args, words, capsys):
    argv = ["plan", "--model", "examples/configs/qwen3-30b-a3b.json", "--dst", "vllm:tp=2"] + args
    assert main(argv) == 2
    assert words in capsys.readouterr().err


def test_colocation_map_on_the_command_line(capsys):
    argv = ["plan", "--model", "examples/configs/qwen3-30b-a3b.json", "--src", "megatron:tp=2", "--dst",
            "vllm:tp=2", "--json"]
    assert main(argv + ["--colocated", "1,0"]) == 0
    swapped = json.loads(capsys.readouterr().out)
    assert main(argv + ["--colocated"]) == 0
    same = json.loads(capsys.readouterr().out)
    assert swapped["colocation"] == [1, 0] and same["colocation"] == [0, 1]
    assert swapped["local_bytes"] < same["local_bytes"] and swapped["total_bytes"] == same["total_bytes"]


def test_own_dtypes_in_the_dry_run(capsys):
    """DeepSeek's float32 router biases: named in --json and counted at four bytes an element."""
    argv = ["plan", "--model", "examples/configs/tiny/deepseek-v3-tiny.json", "--src", "megatron:tp=2",
            "--dst", "vllm:tp=2", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    spec = reshard.ModelSpec.from_hf_config("examples/configs/tiny/deepseek-v3-tiny.json")
    biases = {t.name: "float32" for t in spec.tensors if t.dtype == "float32"}
    assert biases and out["own_dtypes"] == biases
    assert out["model_bytes"] == sum(t.numel * (4 if t.dtype == "float32" else spec.itemsize) for t in spec.tensors)
    assert main(argv[:-1]) == 0 and "own dtype" in capsys.readouterr().out
