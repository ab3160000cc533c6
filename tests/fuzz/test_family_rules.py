"""Fuzz: the rules every model family obeys (positive sizes, heads and kv heads, the head width, the activation,
MoE top-k within the experts) are enforced for every registered family alike: a valid config of each family
(its example under examples/configs, at toy sizes) broken in one generic way is refused with a ModelConfigError
naming the key, whichever family reads it."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import given, settings, strategies as st

import reshard
from reshard.errors import InputError, ModelConfigError
from reshard.layouts.families import discover, read_hf_config
from reshard.layouts.registry import families

pytestmark = pytest.mark.fuzz
CONFIGS = Path(__file__).parents[2] / "examples" / "configs"
BUILT_IN = ("qwen3", "qwen3_moe", "llama", "deepseek_v3", "qwen3_5")


def _examples() -> dict[str, dict[str, Any]]:
    """One toy-sized valid config per family that has an example."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(CONFIGS.glob("*.json")):
        config = read_hf_config(path)
        fam = discover(config)
        if fam.name not in out and "quantization_config" not in config:
            out[fam.name] = fam.tiny_config(config)
    return out


EXAMPLES = _examples()


def _language(config: dict[str, Any]) -> dict[str, Any]:
    """Where the language model's keys sit (a multimodal wrapper nests them in text_config)."""
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def _set(key: str, value: Any) -> Callable[[dict], None]:
    return lambda c: _language(c).__setitem__(key, value)


def _no_head_dim(hidden_offset: int) -> Callable[[dict], None]:
    def change(c: dict) -> None:
        t = _language(c)
        t.pop("head_dim", None)
        t["hidden_size"] = t["num_attention_heads"] * 16 + hidden_offset  # not a multiple of the heads
    return change


def _kv_not_dividing(c: dict) -> None:
    t = _language(c)
    t["num_attention_heads"], t["num_key_value_heads"] = 4, 3


def _topk_over_experts(extra: int) -> Callable[[dict], None]:
    def change(c: dict) -> None:
        t = _language(c)
        experts = next(t[k] for k in ("num_experts", "n_routed_experts", "num_local_experts") if t.get(k))
        t["num_experts_per_tok"] = experts + extra
    return change


# each generic violation: (the key the error must name, a strategy of changes that break the rule, MoE only)
VIOLATIONS: dict[str, tuple[str, st.SearchStrategy, bool]] = {
    "hidden_size_not_positive": ("hidden_size", st.integers(-4, 0).map(lambda v: _set("hidden_size", v)), False),
    "layers_not_positive": ("num_hidden_layers", st.integers(-4, 0).map(lambda v: _set("num_hidden_layers", v)),
                            False),
    "heads_not_positive": ("num_attention_heads", st.integers(-4, 0).map(lambda v: _set("num_attention_heads", v)),
                           False),
    "kv_heads_not_positive": ("num_key_value_heads",
                              st.integers(-4, 0).map(lambda v: _set("num_key_value_heads", v)), False),
    "kv_heads_not_dividing_heads": ("num_key_value_heads", st.just(_kv_not_dividing), False),
    "vocab_not_positive": ("vocab_size", st.integers(-4, 0).map(lambda v: _set("vocab_size", v)), False),
    "heads_not_dividing_hidden": ("hidden_size", st.integers(1, 3).map(_no_head_dim), False),
    "activation_not_silu": ("hidden_act", st.sampled_from(["gelu", "relu", "gelu_pytorch_tanh"]).map(
        lambda v: _set("hidden_act", v)), False),
    "size_not_an_integer": ("hidden_size", st.sampled_from(["64", 64.0, True, None]).map(
        lambda v: _set("hidden_size", v)), False),
    "topk_not_positive": ("num_experts_per_tok", st.integers(-2, 0).map(lambda v: _set("num_experts_per_tok", v)),
                          True),
    "topk_over_experts": ("num_experts_per_tok", st.integers(1, 8).map(_topk_over_experts), True),
}


def test_every_built_in_family_has_an_example():
    registered = {f.name for f in families()}
    assert set(BUILT_IN) <= registered
    assert set(BUILT_IN) <= set(EXAMPLES), sorted(set(BUILT_IN) - set(EXAMPLES))


@pytest.mark.parametrize("family", sorted(EXAMPLES))
def test_the_examples_are_valid(family):
    assert reshard.ModelSpec.from_hf_config(EXAMPLES[family]).family == family


@pytest.mark.parametrize("violation", sorted(VIOLATIONS))
@pytest.mark.parametrize("family", sorted(EXAMPLES))
@settings(max_examples=8)
@given(data=st.data())
def test_every_family_refuses_each_generic_violation_naming_the_key(family, violation, data):
    key, changes, moe_only = VIOLATIONS[violation]
    base = EXAMPLES[family]
    if moe_only and not reshard.ModelSpec.from_hf_config(base).is_moe:
        return
    config = copy.deepcopy(base)
    data.draw(changes)(config)
    with pytest.raises(InputError) as info:
        reshard.ModelSpec.from_hf_config(config)
    assert isinstance(info.value, ModelConfigError), (type(info.value), str(info.value))
    assert info.value.field == key, (family, violation, info.value.field, str(info.value))
    assert key in str(info.value)
