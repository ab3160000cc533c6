"""verl's trainer refitting an EPLB vLLM rollout through reshard is refused when verl builds its manager
(integrations.verl.modes.refuse_eplb): vLLM's load_weights writes experts by the initial placement and the backend's
rollout rank cannot read the engine's placement. Pure functions of verl's composed config: no verl needed."""
from __future__ import annotations

import pytest

from reshard.errors import ArgumentError
from reshard.integrations.verl.modes import refuse_eplb


def trainer(mode: str, eplb: bool | None) -> dict:
    vllm = {} if eplb is None else {"enable_eplb": eplb}
    return {"trainer": {"use_v1": True, "v1": {"trainer_mode": mode}},
            "actor_rollout_ref": {"hybrid_engine": True, "rollout": {
                "nnodes": 1, "n_gpus_per_node": 8, "engine_kwargs": {"vllm": vllm},
                "checkpoint_engine": {"backend": "reshard"}}}}


def test_an_eplb_rollout_refit_through_reshard_is_refused_naming_the_key():
    with pytest.raises(ArgumentError) as e:
        refuse_eplb(trainer("separate_async", True))
    assert e.value.field == "actor_rollout_ref.rollout.engine_kwargs.vllm.enable_eplb"
    assert "initial placement" in str(e.value)


@pytest.mark.parametrize("config", [trainer("separate_async", False), trainer("separate_async", None),
                                    trainer("sync", True), None],
                         ids=["eplb-off", "eplb-unset", "reshard-not-used", "no-trainer-found"])
def test_others_pass(config):
    refuse_eplb(config)
