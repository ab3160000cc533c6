"""The verl backend's `staging` option at construction (no processes): "model" staging refused on a rollout rank
whose receiving device cannot hold the whole model, naming both sizes and the fix; `atomic`, which `staging`
replaced, refused naming its replacement; refit while the engine generates (`pause_for`, `staging` "device" or
"host") refused naming where verl pauses the rollout. The model's bytes are counted on transformers' own model
(meta device), the free memory read from /proc/meminfo here."""
from __future__ import annotations

import re

import pytest
import torch

from reshard.errors import ArgumentError

pytestmark = pytest.mark.verl

# a Qwen3 far larger than any test host's memory (float32: ~0.9 TB), described only (nothing is allocated)
HUGE = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 16384,
        "intermediate_size": 53248, "num_hidden_layers": 64, "num_attention_heads": 128, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 152064, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "tie_word_embeddings": False, "torch_dtype": "float32"}


def engine(**kwargs):
    from reshard.integrations.verl.engine import ReshardCheckpointEngine

    return ReshardCheckpointEngine(1 << 20, model=HUGE, device="cpu", **kwargs)


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def test_model_staging_is_refused_where_the_model_does_not_fit():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in HUGE.items() if k != "architectures"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    need = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    free = mem_available()
    assert need > free, "the test needs a model larger than this host's memory"

    with pytest.raises(ArgumentError) as refused:
        engine(staging="model")  # a rollout rank (no is_master)
    text = str(refused.value)
    numbers = [int(n) for n in re.findall(r"\((\d+) bytes", text)]
    assert numbers[0] == need, text  # the model's bytes, then the free bytes
    assert abs(numbers[1] - free) < 1 << 30, text
    assert "staging: bucket" in text and "engine_kwargs.reshard.staging" in text, text
    # the trainer ranks stage nothing on the rollout's device, and bucket staging holds two groups
    engine(staging="model", is_master=False)
    engine(staging="bucket")
    engine()


@pytest.mark.parametrize("options,named", [({"atomic": True}, "staging: model"),
                                           ({"atomic": False}, "staging"),
                                           ({"staging": "all"}, "('bucket', 'model')"),
                                           # refit while the engine generates: verl's manager pauses around it all
                                           ({"staging": "device"}, "verl/checkpoint_engine/base.py:523-560"),
                                           ({"staging": "host", "pause_for": "flip"}, "pause_for='flip' is "
                                            "reshard's refit while the engine generates"),
                                           ({"pause_for": "refit"}, "docs/guides/verl.md, 'Refit while the engine "
                                            "generates'"),
                                           # delta refits: the held version lives in model staging's buffers
                                           ({"delta": 4}, "delta=4 needs staging: model"),
                                           ({"delta": 4, "staging": "model", "fanout": 1},
                                            "delta=4 needs fanout unset")])
def test_atomic_and_unknown_stagings_are_refused_naming_the_fix(options, named):
    from reshard.integrations.verl import modes

    with pytest.raises(ArgumentError, match=re.escape(named)):
        engine(**options)
    # in the driver too, where verl's manager checks the config block
    block = {"backend": "reshard", "engine_kwargs": {"reshard": {"model": "/m", **options}}}
    with pytest.raises(ArgumentError, match=re.escape(named)):
        modes.check_checkpoint_engine(block)
