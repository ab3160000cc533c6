"""The validation workflow on tiny instances of every registered family: discovery and the round-trip property
run everywhere; Megatron layout parity against real megatron-core models (marker megatron); vLLM layout
parity against real vLLM model code (marker vllm; runs in the vLLM venv). A stage that cannot run must say
"not run", and here that fails the test of that stage."""
from __future__ import annotations

import pytest

from reshard.layouts.families import discover, read_hf_config, registered_families
from reshard.validate import FAIL, NOT_RUN, PASS, validate

# One example config per registered family (examples/configs); kimi-k2 shares the deepseek_v3 family, the dense
# Qwen3.6 the qwen3_5 family of the MoE Qwen3.5.
CONFIGS = {
    "qwen3": "examples/configs/qwen3-0.6b.json",
    "llama": "examples/configs/llama-3.1-70b.json",
    "qwen3_moe": "examples/configs/qwen3-30b-a3b.json",
    "deepseek_v3": "examples/configs/deepseek-v3.json",
    "qwen3_5": "examples/configs/qwen3.5-35b-a3b.json",
}
EXTRA = ["examples/configs/kimi-k2.json", "examples/configs/qwen3.6-27b.json"]


def test_every_registered_family_has_a_validation_config():
    assert sorted(CONFIGS) == registered_families()
    for name, path in CONFIGS.items():
        assert discover(read_hf_config(path)).name == name


def _one(config: str, stage: str, **kw):
    results = {r.stage: r for r in validate(config, stages=[stage], **kw)}
    assert results["discovery"].status == PASS, results["discovery"].detail
    return results[stage]


@pytest.mark.parametrize("config", [*CONFIGS.values(), *EXTRA])
def test_round_trip_stage(config):
    r = _one(config, "round trip", examples=8)
    assert r.status == PASS, r.detail


@pytest.mark.megatron
@pytest.mark.parametrize("config", [CONFIGS["qwen3_moe"], CONFIGS["deepseek_v3"], CONFIGS["llama"],
                                    CONFIGS["qwen3_5"], EXTRA[1]])
def test_megatron_layout_stage(config):
    r = _one(config, "megatron layout")
    assert r.status == PASS, r.detail


@pytest.mark.vllm
@pytest.mark.parametrize("config", [CONFIGS["deepseek_v3"], CONFIGS["qwen3_moe"], CONFIGS["qwen3_5"]])
def test_vllm_layout_stage(config):
    r = _one(config, "vllm layout")
    assert r.status == PASS, r.detail


def test_stages_without_their_dependency_say_not_run():
    results = {r.stage: r for r in validate(CONFIGS["qwen3"], stages=["hf parity", "vllm load parity"])}
    for stage in ("hf parity", "vllm load parity"):
        assert results[stage].status == NOT_RUN and results[stage].detail


def test_unknown_architecture_lists_the_supported_ones():
    results = validate({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, stages=["round trip"])
    assert results[0].status == FAIL and "DeepseekV3ForCausalLM" in results[0].detail
    assert results[1].status == NOT_RUN
