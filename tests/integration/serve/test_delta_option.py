"""`RefitSpec(delta=K)`, the user-facing delta option (issue 41 item 5): validated like every field, carried into the
executors both sides open through the transports' openers (adapters.refit.open_transport), refused for what cannot
carry it. In process: a Megatron trainer's shards refit through `TrainerSession` into an HF checkpoint directory
(adapters.hf_dir, the "inprocess" transport): a keyframe, then deltas after a few elements and a whole step
changed, each leaving the checkpoint transformers loads equal to the trainer's weights. (The server path, over the
collective transport: test_serve.py::test_delta_refits_equal_dense_ones.)"""
from __future__ import annotations

import json

import pytest
import torch

import reshard
from reshard.adapters import transports
from reshard.adapters.hf_dir import HfDirectoryEngine, HfDirectoryLayout
from reshard.adapters.refit import RefitSpec
from reshard.adapters.trainer import TrainerSession
from reshard.errors import ArgumentError, PlanError
from reshard.executors import shard

CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 160, "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32"}


def _layouts():
    spec = reshard.ModelSpec.from_hf_config(CONFIG).model_copy(update={"dtype": "float32"})
    return spec, reshard.MegatronLayout(model=spec, tp=2), HfDirectoryLayout(model=spec, writers=2)


@pytest.mark.parametrize("fields,message", [
    ({"delta": 0}, "delta=0: a dense keyframe every K >= 1 versions"),
    ({"delta": True}, "delta=True has type bool"),
    ({"delta": "4"}, "delta='4' has type str"),
    ({"delta": 4, "fanout": 1}, "delta refits need a plan without fan-out"),
    ({"delta": 4, "options": {"delta": 4}}, "delta refits are RefitSpec(delta=K)"),
])
def test_a_bad_delta_option_is_refused_naming_the_field(fields, message):
    spec, src, dst = _layouts()
    with pytest.raises(PlanError) as e:
        RefitSpec.of(spec, src, dst, transport="inprocess", **fields)
    assert message in str(e.value)


def test_a_transport_that_cannot_carry_deltas_is_refused_naming_it():
    spec, src, dst = _layouts()
    transports.register_transport("dense-only", lambda e: None, cross_process=False)
    try:
        with pytest.raises(PlanError, match="transport 'dense-only' does not carry delta refits"):
            RefitSpec.of(spec, src, dst, transport="dense-only", delta=4)
        RefitSpec.of(spec, src, dst, transport="dense-only")  # dense refits it carries
    finally:
        transports._TRANSPORTS.pop("dense-only")


def test_delta_refits_through_the_session_equal_the_trainers_weights(tmp_path):
    transformers = pytest.importorskip("transformers")
    spec, src, dst = _layouts()
    refit = RefitSpec.of(spec, src, dst, transport="inprocess", delta=3)
    assert RefitSpec.from_dict(json.loads(json.dumps(refit.to_dict()))) == refit  # travels as JSON
    g = torch.Generator().manual_seed(0)
    weights = {t.name: torch.randn(t.shape, generator=g) for t in spec.tensors}
    shards = shard(src, weights)
    engine = HfDirectoryEngine(tmp_path / "ckpt", CONFIG)
    session = TrainerSession(refit, 0, shards, engines=[engine], lease=None)

    def step(change) -> None:  # the trainer's shards change in place, as an optimizer step does
        change(weights)
        for rank, tensors in shard(src, weights).items():
            for name, t in tensors.items():
                shards[rank][name].copy_(t)

    def refit_and_check(version: str):
        session.refit(version)
        state = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).state_dict()
        assert all(torch.equal(state[n], w) for n, w in weights.items()), version
        return engine.executor.last_delta  # the engine's side of the in-process transport

    def few(w) -> None:
        w["model.embed_tokens.weight"][7, 3] += 1.0
        w["model.layers.1.mlp.down_proj.weight"][5, :4] -= 0.5

    session.init()
    try:
        assert refit_and_check("v1").keyframe
        step(few)
        report = refit_and_check("v2")
        assert not report.keyframe and report.base == 1 and report.changed == 5, report
        assert report.wire_bytes < report.dense_bytes // 50, report
        step(lambda w: w.update({n: t * 0.9 for n, t in w.items()}))  # every element changes: dense entries
        report = refit_and_check("v3")
        assert not report.keyframe and report.ops["dense"] == report.entries > 0, report
        assert refit_and_check("v4").keyframe  # the policy's: a keyframe every 3 versions
        session.init()  # the engine bound afresh: its first refit is a keyframe, never a delta against nothing
        step(few)
        assert refit_and_check("v5").keyframe
    finally:
        session.close()


def test_the_verl_backend_takes_delta_with_model_staging_only():
    """The rule both integrations share (integrations.groups.check_options), in verl's config block; the refits
    themselves: tests/integration/verl and nemo_rl, test_delta_refits_move_only_the_changes."""
    from reshard.integrations.verl.topology import check_options

    with pytest.raises(ArgumentError, match=r"engine_kwargs\.reshard\.delta=4 needs staging: model"):
        check_options({"delta": 4})
    with pytest.raises(ArgumentError, match=r"engine_kwargs\.reshard\.delta=4 needs fanout unset"):
        check_options({"delta": 4, "staging": "model", "fanout": 2})
    assert check_options({"delta": 4, "staging": "model"}) == {"delta": 4, "staging": "model"}
