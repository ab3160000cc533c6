"""ReshardCheckpointEngine on one GPU (the GPU machine: `pytest -m gpu`): a policy worker and a vLLM worker, two
processes on the same GPU, checksummed (sum64, computed on the GPU), over the shared transport (the policy writing
straight into the vLLM worker's buckets through CUDA IPC) and the collective one (the engine's own NCCL group, each
process a host of its own to NCCL over loopback sockets: reshard.testing.world). Needs torch, reshard and its own
dependencies (pydantic, numpy) only: the model is a config, its weights drawn per tensor from a seed in each process
(the ground truth, independent of reshard), NeMo-RL's call order replayed by harness.nemo_rl_jobs, no vLLM.

Three refits: clean, refused (a tensor the model does not have after the last one: every process fails, the
last batch is never yielded) and clean again (the transport is rebuilt and a whole version lands).
"""
from __future__ import annotations

import pytest

from reshard.testing.world import run_world

pytestmark = pytest.mark.gpu

JOB = "harness.nemo_rl_jobs:nemo_rl_worker"
CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256, "intermediate_size": 768,
          "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
          "vocab_size": 2048, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
          "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
BUCKET = 1 << 19  # 26 groups of the 11.5 MB model, the largest 1 MiB (the embedding)


@pytest.mark.parametrize("transport", ["shared", "collective"])
@pytest.mark.parametrize("staging", ["bucket", "model"])
def test_transports_on_one_gpu(tmp_path, staging, transport, device="cuda"):
    """`device`: "cpu" runs the same through POSIX shared memory (to check the test itself without a GPU)."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    job = {"config": CONFIG, "policy": 1, "rollout": 1, "steps": 3, "dir": str(tmp_path), "bucket_size": BUCKET,
           "device": device, "faults": {"2": "extra-last"},
           "kwargs": {"transport": transport, "device": device, "staging": staging, "checksum": "sum64",
                      "timeout": 60}}
    results = run_world(2, JOB, job, tmp_path, timeout=300)
    assert all(r is not None for r in results), (tmp_path / "logs.txt").read_text()[-4000:]
    policy, rollout = results
    groups = rollout["groups"]
    assert len(groups) > 3
    for step in (1, 3):
        entry = rollout["refits"][step - 1]
        assert "error" not in entry and "error" not in policy["refits"][step - 1], (entry, policy["refits"])
        assert entry["equal"], entry["wrong"]
        assert [b["names"] for b in entry["batches"]] == groups
        assert policy["refits"][step - 1]["bytes_sent"] == rollout["model_bytes"]
    refused = rollout["refits"][1]
    assert "model.layers.0.mlp.extra.weight" in refused["error"] and not refused["wrong"]
    assert [b["names"] for b in refused["batches"]] == (groups[:-1] if staging == "bucket" else [])
    assert refused["error_at"] - policy["refits"][1]["fault_at"] < 20.0
    held = rollout["refits"][-1]["held_bytes"]
    assert held < rollout["model_bytes"] / 2 if staging == "bucket" else held >= rollout["model_bytes"]
