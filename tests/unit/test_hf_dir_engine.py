"""A second destination engine kind, added by registrations only (reshard.adapters.hf_dir): a Megatron trainer's
shards (tp=2, pp=2) refit through `RefitSpec` and the `TrainerSession` into an HF checkpoint directory written by
three writers, which transformers' own `from_pretrained` loads with every tensor equal to the trainer's weights."""
from __future__ import annotations

import json

import pytest
import torch

import reshard
from reshard.adapters.engines import EngineClient, Leased, Pausable
from reshard.adapters.hf_dir import HfDirectoryEngine, HfDirectoryLayout
from reshard.adapters.refit import RefitSpec
from reshard.adapters.trainer import TrainerSession
from reshard.executors import shard

transformers = pytest.importorskip("transformers")

CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 160, "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32"}


def _weights(spec: reshard.ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=g) for t in spec.tensors}


def test_megatron_shards_refit_into_a_checkpoint_transformers_loads(tmp_path):
    spec = reshard.ModelSpec.from_hf_config(CONFIG).model_copy(update={"dtype": "float32"})
    src, dst = reshard.MegatronLayout(model=spec, tp=2, pp=2), HfDirectoryLayout(model=spec, writers=3)
    refit = RefitSpec.of(spec, src, dst, transport="inprocess")
    assert RefitSpec.from_dict(json.loads(json.dumps(refit.to_dict()))) == refit  # travels as JSON
    weights = _weights(spec, 0)
    shards = shard(src, weights)  # the trainer's tensors, updated in place by its steps
    engine = HfDirectoryEngine(tmp_path / "ckpt", CONFIG)
    assert isinstance(engine, EngineClient) and not isinstance(engine, (Pausable, Leased))
    session = TrainerSession(refit, 0, shards, engines=[engine], lease=None)
    session.init()
    try:
        for step in (1, 2):
            if step == 2:  # a training step: the trainer's shards change in place
                weights = _weights(spec, step)
                for rank, tensors in shard(src, weights).items():
                    for name, t in tensors.items():
                        shards[rank][name].copy_(t)
            session.refit(f"step-{step}")
            model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
            state = model.state_dict()
            assert set(state) == set(weights)
            for name, w in weights.items():
                assert torch.equal(state[name], w), name
            index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
            assert index["metadata"]["weight_version"] == f"step-{step}"
    finally:
        session.close()
    files = sorted(set(index["weight_map"].values()))
    assert files == [dst.file_name(w) for w in range(3)]  # one file per writer, layers split among them
    assert index["weight_map"]["model.embed_tokens.weight"] == dst.file_name(0)
    assert index["weight_map"]["model.layers.3.mlp.down_proj.weight"] == dst.file_name(2)


def test_the_hf_directory_refuses_what_it_cannot_hold():
    spec = reshard.ModelSpec.from_hf_config(CONFIG)
    src = reshard.MegatronLayout(model=spec, tp=2)
    with pytest.raises(reshard.LayoutError, match="hf_dir layout accepts install \\['direct'\\]"):
        RefitSpec.of(spec, src, HfDirectoryLayout(model=spec), install="loader")
    with pytest.raises(reshard.LayoutError, match="writers=5 exceeds"):
        HfDirectoryLayout(model=spec, writers=5)
    from reshard.layouts.lora import lora_spec

    with pytest.raises(reshard.LayoutError, match="hf_dir engine has no cuts for the lora family"):
        HfDirectoryLayout(model=lora_spec(spec, 4, 8))
    with pytest.raises(reshard.ExecutionError, match="needs a process per writer"):
        HfDirectoryEngine("unused", CONFIG).init_weight_transfer_engine(
            RefitSpec.of(spec, src, HfDirectoryLayout(model=spec), transport="shared").to_dict())
