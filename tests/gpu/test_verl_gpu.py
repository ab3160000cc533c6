"""The verl backend on one GPU (the GPU machine: `pytest -m gpu`): a trainer rank and a rollout rank, two
processes on the same GPU, with "sum64" checksums computed on the GPU, over the shared transport (CUDA IPC) and the
collective one (the backend's own NCCL group, each process a host of its own to NCCL over loopback sockets:
reshard.testing.world) (tests/gpu/verl_gpu_job.py replays verl's lifecycle; verl's own manager drives the backend
on CPU in the verl stage).

Three refits: clean, refused (a tensor the model does not have after the last one: both processes fail; with
staging bucket the groups before the last may have been handed on, never the last; with staging model nothing) and
clean again; every tensor handed on equals the seed's.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from reshard.testing.world import run_world

pytestmark = pytest.mark.gpu

CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 256,
          "intermediate_size": 768, "moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
          "vocab_size": 2048, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
          "tie_word_embeddings": False, "torch_dtype": "bfloat16", "decoder_sparse_step": 1, "mlp_only_layers": []}


@pytest.mark.parametrize("transport", ["shared", "collective"])
@pytest.mark.parametrize("staging", ["bucket", "model"])
def test_verl_backend_on_one_gpu(tmp_path: Path, monkeypatch, staging: str, transport: str, device: str = "cuda"):
    """`device`: "cpu" runs the same through POSIX shared memory (to check the test itself without a GPU)."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", here + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("RESHARD_HOST", "127.0.0.1")
    job = {"config": CONFIG, "bucket_size": 1 << 19, "staging": staging, "device": device, "transport": transport}
    results = run_world(2, "verl_gpu_job:verl_rank", job, tmp_path, timeout=300)
    assert all(r is not None for r in results), (tmp_path / "logs.txt").read_text()[-4000:]
    trainer, rollout = results
    assert trainer["groups"] > 3
    for step in (1, 3):
        t, r = trainer["refits"][step - 1], rollout["refits"][step - 1]
        assert "error" not in t and "error" not in r, (t, r)
        assert r["handed"] == rollout["tensors"] and not r["wrong"], r
    t, r = trainer["refits"][1], rollout["refits"][1]
    assert "model.layers.0.mlp.extra.weight" in t["error"] and "error" in r, (t, r)
    assert not r["wrong"], r
    assert r["handed"] < rollout["tensors"] if staging == "bucket" else r["handed"] == 0, r
    print(f"verl on one GPU, {transport}, staging {staging}: refits {[e['seconds'] for e in rollout['refits']]} s; "
          f"stand-in for verl: {rollout['stand_in']}")
