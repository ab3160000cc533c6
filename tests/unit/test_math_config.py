"""The config fields that change the math but no shape (layouts.math_config): read alike from either
transformers' way of writing rope, compared field by field, refused at a vLLM worker's init (the server test)."""
from __future__ import annotations

from dataclasses import replace

import pytest

import reshard
from reshard.adapters.refit import RefitSpec
from reshard.errors import PlanError
from reshard.layouts.math_config import math_config, math_differences, math_fingerprint
from reshard.testing.megatron_cpu import TinyGPT


def test_rope_written_either_way_is_the_same_math():
    old = {"rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 4.0}, "rms_norm_eps": 1e-6}
    new = {"rope_parameters": {"rope_theta": 1000000, "rope_type": "yarn", "factor": 4}, "rms_norm_eps": 1e-06}
    assert math_differences(math_config(old), math_config(new)) == []
    plain = {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}
    assert math_config(plain) == math_config({"rope_theta": 10000}) == {"rope_theta": 10000.0}


def test_a_rope_type_vllm_renames_is_the_checkpoints():
    """vLLM serves DeepSeek's yarn as "deepseek_yarn" in the config it keeps (the families' mismatch stage found
    every DeepSeek-V3 refit refused for it); another rope type still differs."""
    yarn = {"rope_type": "yarn", "factor": 40, "mscale": 1.0, "original_max_position_embeddings": 4096}
    served = {"rope_scaling": {**yarn, "rope_type": "deepseek_yarn"}}
    assert math_differences(math_config({"rope_scaling": yarn}), math_config(served)) == []
    other = {"rope_scaling": {**yarn, "rope_type": "longrope"}}
    assert len(math_differences(math_config({"rope_scaling": yarn}), math_config(other))) == 1


@pytest.mark.parametrize("field,value", [("num_experts_per_tok", 4), ("rms_norm_eps", 1e-5), ("hidden_act", "gelu"),
                                         ("rope_theta", 5e5), ("norm_topk_prob", False)])
def test_each_field_that_changes_the_math_is_told_apart(field, value):
    trainer = math_config({"num_experts_per_tok": 2, "rms_norm_eps": 1e-6, "hidden_act": "silu",
                           "rope_theta": 1e6, "norm_topk_prob": True})
    engine = {**trainer, field: value}
    differ = math_differences(trainer, engine)
    assert len(differ) == 1 and differ[0].startswith(field)
    assert math_fingerprint(trainer) != math_fingerprint(engine)


def test_a_field_only_one_side_sets_is_not_compared():
    assert math_differences({"rms_norm_eps": 1e-6}, {"rope_theta": 1e4}) == []


def test_refit_specs_carry_the_trainers_math():
    config = TinyGPT().hf_config().to_dict()
    spec = reshard.ModelSpec.from_hf_config(config)
    refit = RefitSpec.of(spec, reshard.MegatronLayout(model=spec), reshard.VllmLayout(model=spec), config=config)
    assert refit.math == math_config(config) and "rms_norm_eps" in refit.math
    assert RefitSpec.from_dict(refit.to_dict()) == refit
    with pytest.raises(PlanError, match="math"):
        replace(refit, math=["rms_norm_eps"])
