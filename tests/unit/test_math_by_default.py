"""The model-config fields that change the math but no shape are checked by default: a spec read from an HF
config carries them (`ModelSpec.math`), `RefitSpec.of` sends them without `config=`, and the engine's check
(adapters.vllm.session.check_served_model, what every vLLM worker runs at init) refuses a model whose config
differs -- here MoE top-k 4 on the trainer against top-k 2 in the engine's transformers config. Carrying them
changes no equality, hash, dump or digest (specs, plans, verl's model digest), so nothing that compares specs
across processes changes."""
from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

import reshard
from reshard.adapters.refit import RefitSpec
from reshard.adapters.vllm.session import check_served_model
from reshard.errors import ArgumentError, LayoutMismatchError
from reshard.integrations.verl.topology import model_digest
from reshard.layouts.lora import lora_spec

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"


def _moe_config(top_k: int) -> dict:
    """A small Qwen3-MoE config (the 30B-A3B's keys, fewer layers and experts) with MoE top-k `top_k`."""
    config = json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text())
    config.update(num_hidden_layers=2, num_experts=8, max_window_layers=2, hidden_size=256, intermediate_size=512,
                  moe_intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  vocab_size=512, num_experts_per_tok=top_k)
    return config


def _engine(config: dict) -> types.SimpleNamespace:
    """What a vLLM worker reads of its config (`vllm_config.model_config.hf_config` is a transformers config;
    one replica, TP 1): here the transformers config the engine's process would load from `config`."""
    from transformers import Qwen3MoeConfig

    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    hf = Qwen3MoeConfig(**fields, architectures=config["architectures"])
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(hf_config=hf, dtype=torch.bfloat16),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1, enable_expert_parallel=False,
                                              pipeline_parallel_size=1, data_parallel_size=1))


def test_a_top_k_4_trainer_is_refused_by_a_top_k_2_engine_without_config():
    spec = reshard.ModelSpec.from_hf_config(_moe_config(4))
    dst = reshard.VllmLayout(model=spec)
    refit = RefitSpec.of(spec, reshard.MegatronLayout(model=spec), dst, install="loader")  # no config=
    assert refit.math["num_experts_per_tok"] == 4
    with pytest.raises(LayoutMismatchError, match="num_experts_per_tok: trainer 4, engine 2") as e:
        check_served_model(refit, refit.layouts()[1], _engine(_moe_config(2)))
    assert "MoE top-k" in str(e.value) and "math=None" in str(e.value)
    check_served_model(refit, refit.layouts()[1], _engine(_moe_config(4)))  # the same config: accepted
    # a refit that travelled as JSON (the init payload) is checked alike
    travelled = RefitSpec.from_dict(json.loads(json.dumps(refit.to_dict())))
    with pytest.raises(LayoutMismatchError, match="num_experts_per_tok"):
        check_served_model(travelled, travelled.layouts()[1], _engine(_moe_config(2)))


def test_config_still_works_overrides_the_spec_and_math_none_opts_out(tmp_path):
    spec = reshard.ModelSpec.from_hf_config(_moe_config(4))
    src, dst = reshard.MegatronLayout(model=spec), reshard.VllmLayout(model=spec)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_moe_config(2)))
    assert RefitSpec.of(spec, src, dst, config=str(path)).math["num_experts_per_tok"] == 2
    assert RefitSpec.of(spec, src, dst, math=None).math is None
    with pytest.raises(ArgumentError, match="both given"):
        RefitSpec.of(spec, src, dst, config=str(path), math=None)
    other = _moe_config(4)
    other["num_experts"] = 16  # another model's config: refused, naming the model
    with pytest.raises(ArgumentError, match="is not the config of the model"):
        RefitSpec.of(spec, src, dst, config=other)
    bare = reshard.ModelSpec(**spec.model_dump())  # made field by field: no math known, none sent
    assert bare.math is None and RefitSpec.of(bare, src, dst).math is None


def test_an_adapter_refit_takes_the_base_models_config():
    config = json.loads((CONFIGS / "qwen3-0.6b.json").read_text())
    base = reshard.ModelSpec.from_hf_config(config)
    spec = lora_spec(base, 8, 16.0)
    from reshard.layouts.lora import VllmLoraLayout

    refit = RefitSpec.of(spec, reshard.MegatronLayout(model=spec), VllmLoraLayout(model=spec, max_lora_rank=8),
                         install="lora_slot", lora_id=1, config=config)
    assert refit.math == base.math and refit.math["rms_norm_eps"] == config["rms_norm_eps"]


def test_the_math_changes_no_equality_hash_dump_or_digest():
    """Specs compare by where bytes live: the engine's own spec (vLLM's config, read without math) equals the
    trainer's, plans and their digests are shared, and verl's model digest (trainer vs rollout) is unchanged."""
    four, two = (reshard.ModelSpec.from_hf_config(_moe_config(k)) for k in (4, 2))
    plain = reshard.layouts.spec_from_hf_config(_moe_config(4))
    assert four.math != two.math and plain.math is None
    assert four == two == plain and hash(four) == hash(two) == hash(plain)
    assert four.model_dump() == plain.model_dump() and four.model_dump_json() == plain.model_dump_json()
    assert model_digest(four) == model_digest(two) == model_digest(plain)
    plans = [reshard.compile(reshard.MegatronLayout(model=s, tp=2), reshard.VllmLayout(model=s)) for s in
             (four, two, plain)]
    assert len({p.digest for p in plans}) == 1
    # kept through model_copy (a dtype changed changes no config field), and the stored form is read-only JSON
    assert four.model_copy(update={"dtype": "float32"}).math == four.math
    four.math["num_experts_per_tok"] = 99
    assert four.math["num_experts_per_tok"] == 4
