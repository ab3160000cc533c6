"""Fuzz: invalid HF configs, config files, layout strings and layout constructors, drawn from the grammar of
valid ones (harness.hostile). Each must raise the library's InputError naming the key, option or field
to blame; nothing else may escape (no pydantic, numpy, json or Python error)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

import reshard
from reshard.errors import InputError, LayoutError, LimitError, ModelConfigError
from harness.hostile import (LAYOUT_OPTIONS, config_documents, invalid_configs, invalid_constructor_values,
                                     invalid_layout_strings, valid_configs)

pytestmark = pytest.mark.fuzz
SPEC = reshard.ModelSpec(family="qwen3_moe", hidden_size=32, num_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=8, intermediate_size=64, vocab_size=128, qk_norm=True,
                         num_experts=8, moe_intermediate_size=16, dense_layers=(0,))


@given(valid_configs())
def test_valid_configs_are_accepted(config):
    reshard.ModelSpec.from_hf_config(config)


@given(invalid_configs())
def test_invalid_configs_name_the_key(case):
    config, key = case
    with pytest.raises(InputError) as info:
        reshard.ModelSpec.from_hf_config(config)
    assert isinstance(info.value, (ModelConfigError, LimitError)), type(info.value)
    assert info.value.field is not None and info.value.field.startswith(key), (info.value.field, key, str(info.value))
    assert key in str(info.value)


@settings(max_examples=40)
@given(config_documents())
def test_config_files_that_are_not_config_objects_are_refused(tmp_path_factory, doc):
    data, words = doc
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_bytes(data)
    with pytest.raises(ModelConfigError) as info:
        reshard.ModelSpec.from_hf_config(str(path))
    assert str(path) in str(info.value) and words in str(info.value), str(info.value)


def test_config_paths_that_are_not_files_are_refused(tmp_path):
    import os

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # opened non-blocking and refused: a reader would otherwise block forever
    for path, words in ((tmp_path, "directory without a config.json"), (fifo, "not a regular file"),
                        (tmp_path / "none.json", "does not exist")):
        with pytest.raises(ModelConfigError, match=words):
            reshard.ModelSpec.from_hf_config(str(path))
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"pad": "x" * (17 << 20)}))
    with pytest.raises(ModelConfigError, match="the limit is"):
        reshard.ModelSpec.from_hf_config(str(big))


@given(invalid_layout_strings())
def test_invalid_layout_strings_name_the_option(case):
    text, key = case
    with pytest.raises(InputError) as info:
        reshard.parse_layout(text, SPEC)
    assert isinstance(info.value, (LayoutError, LimitError)), type(info.value)
    assert key in str(info.value), (text, str(info.value))
    field = info.value.field or ""
    assert field.startswith(key) or key.startswith(field.split(" ")[0]) or field == "layout", (field, key)


@given(st.sampled_from(sorted(LAYOUT_OPTIONS)).flatmap(
    lambda kind: st.tuples(st.just(kind), st.sampled_from(sorted(LAYOUT_OPTIONS[kind])))).flatmap(
    lambda kk: st.tuples(st.just(kk[0]), st.just(kk[1]), invalid_constructor_values(LAYOUT_OPTIONS[kk[0]][kk[1]][0], kk[1]))))
def test_invalid_layout_constructor_values_name_the_field(case):
    kind, key, value = case
    cls = reshard.layouts.registered_layouts()[kind]
    with pytest.raises(InputError) as info:
        cls(model=SPEC, **{key: value})
    assert key in str(info.value), (kind, key, value, str(info.value))


def test_trainer_configurations_megatron_core_accepts_are_accepted():
    dense = reshard.ModelSpec.from_hf_config("examples/configs/qwen3-8b.json")
    assert reshard.MegatronLayout(model=dense, tp=2, etp=1).world == 2  # etp is unused by a dense model
    with pytest.raises(LayoutError, match="ep=2 needs a MoE model") as info:
        reshard.MegatronLayout(model=dense, ep=2)
    assert info.value.field == "ep"
    with pytest.raises(LayoutError, match="num_query_groups") as info:
        three = reshard.ModelSpec(**{**SPEC.model_dump(), "num_attention_heads": 6, "num_key_value_heads": 3})
        reshard.MegatronLayout(model=three, tp=2)  # megatron-core: query groups a multiple or divisor of tp
    assert info.value.field == "tp"


def test_deepseek_without_topk_method_says_which_key_settles_it():
    config = json.loads(Path("examples/configs/tiny/deepseek-v3-tiny.json").read_text())
    del config["topk_method"]
    with pytest.raises(ModelConfigError) as info:
        reshard.ModelSpec.from_hf_config(config)
    assert info.value.field == "topk_method"
    for words in ("e_score_correction_bias", "transformers", "vLLM", "noaux_tc"):
        assert words in str(info.value)
