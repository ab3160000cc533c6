"""A model family defined outside the library -- here, in this file -- is registered by one explicit call
(`register_family`) and then works like a built-in one: discovery, both layouts, compile, execute, round trip. No
library file is edited."""
from __future__ import annotations

from typing import Any

import pytest
import torch

import reshard
from reshard.executors import allocate, execute_local, shard, unshard
from reshard.errors import ArgumentError, ModelConfigError
from reshard.layouts import (HfLayout, MegatronLayout, ModelFamily, VllmLayout, register_family,
                             registered_families)
from reshard.layouts.cuts import ColumnBlocks, Replicated
from reshard.layouts.roles import tensor_kind
from reshard.layouts.family import LAYER, attention_layer, dense_mlp
from reshard.layouts.model import Entry, ModelSpec

# A per-layer gain vector, whole on every rank, and a [H, H] mixing matrix cut into column blocks; Megatron and
# vLLM name them differently (Megatron's names follow `decoder.layers.{index in the chunk}.`, vLLM's are full).
GAIN = tensor_kind("toy_gain", Replicated("self_attention.gain"), Replicated(LAYER + "self_attn.gain"))
MIX = tensor_kind("toy_mix", ColumnBlocks("mlp.mix.weight"), ColumnBlocks(LAYER + "mlp.mix_proj.weight"))


@register_family
class ToyQwen3(ModelFamily):
    """Qwen3 with two extra tensors per layer, under its own architecture name."""

    name = "toy_qwen3"
    architectures = ("ToyQwen3ForCausalLM",)

    def spec(self, config: dict[str, Any], include_mtp: bool = False) -> ModelSpec:
        return ModelSpec(**self._common(config, qk_norm=True))

    def layer(self, spec: ModelSpec, i: int) -> list:
        H = spec.hidden_size
        return [*attention_layer(spec, dense_mlp(spec)), Entry(LAYER + "self_attn.gain", (H,), GAIN),
                Entry(LAYER + "mlp.mix_proj.weight", (H, H), MIX)]


CONFIG = {"architectures": ["ToyQwen3ForCausalLM"], "hidden_size": 16, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4, "intermediate_size": 24,
          "vocab_size": 100, "torch_dtype": "float32"}


class Unregistered(ModelFamily):
    """Defined, never registered: defining a family registers nothing."""

    name = "toy_unregistered"
    architectures = ("ToyUnregisteredForCausalLM",)

    def spec(self, config: dict[str, Any], include_mtp: bool = False) -> ModelSpec:
        return ModelSpec(**self._common(config, qk_norm=True))

    def layer(self, spec: ModelSpec, i: int) -> list:
        return attention_layer(spec, dense_mlp(spec))


def test_only_an_explicit_call_registers_a_family():
    assert "toy_unregistered" not in registered_families()
    with pytest.raises(ModelConfigError, match="unknown architecture"):
        reshard.ModelSpec.from_hf_config({**CONFIG, "architectures": ["ToyUnregisteredForCausalLM"]})
    with pytest.raises(ArgumentError, match="ModelFamily subclass"):
        register_family(ModelFamily)  # abstract: nothing to register


def test_a_family_defined_here_is_registered_and_discovered():
    spec = reshard.ModelSpec.from_hf_config(CONFIG)
    assert "toy_qwen3" in registered_families() and spec.family == "toy_qwen3"
    assert spec.tensor("model.layers.3.mlp.mix_proj.weight").role is MIX
    m = MegatronLayout(model=spec, tp=2, pp=2)
    assert {p.tensor for p in m.placements(spec.tensor("model.layers.3.self_attn.gain"))} == {
        "decoder.layers.1.self_attention.gain"}
    assert m.rank_tensors(3)["decoder.layers.1.mlp.mix.weight"] == (16, 8)


def test_a_family_defined_here_compiles_executes_and_round_trips():
    spec = reshard.ModelSpec.from_hf_config(CONFIG)
    g = torch.Generator().manual_seed(0)
    weights = {t.name: torch.randn(t.shape, generator=g) for t in spec.tensors}
    layouts = [MegatronLayout(model=spec, tp=2, pp=2, world=8), MegatronLayout(model=spec, tp=4, naming="te"),
               VllmLayout(model=spec, tp=2, replicas=2), VllmLayout(model=spec, tp=4), HfLayout(model=spec)]
    for src in layouts[:2]:
        for dst in layouts:
            plan = reshard.compile(src, dst)
            got = allocate(dst, fill=-7.0)
            execute_local(plan, shard(src, weights), got)
            want = shard(dst, weights, fill=-7.0)
            assert all(torch.equal(got[r][n], want[r][n]) for r in want for n in want[r]), (src, dst)
            back = unshard(dst, got)
            assert all(torch.equal(back[n], w) for n, w in weights.items()), (src, dst)
