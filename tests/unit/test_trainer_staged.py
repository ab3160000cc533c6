"""pause_for="flip" (issue 40): the driver pauses only once every engine that tells (`ReportsStaged`) reports its
staged transfer ended, waiting for it in the "staged" phase; a landing that failed is reported then, before any
pause or install; the wait is bounded by the refit's deadline."""
from __future__ import annotations

import pytest
import torch

import reshard
from reshard.adapters.engines import EngineClient, Pausable, ReportsStaged, landing_ended
from reshard.adapters.refit import RefitSpec
from reshard.adapters.trainer import TrainerSession
from reshard.errors import ExecutionError
from reshard.executors import shard
from reshard.testing.megatron_cpu import TinyGPT

SPEC = reshard.ModelSpec.from_hf_config(TinyGPT().hf_config().to_dict())
SRC = reshard.MegatronLayout(model=SPEC, tp=1)


class Landing(EngineClient, Pausable, ReportsStaged):
    """An engine whose two workers' staged transfer ends after `polls` questions (or fails with `error`)."""

    def __init__(self, polls: int, error: str | None = None) -> None:
        self.polls, self.error, self.calls = polls, error, []

    def init_weight_transfer_engine(self, init_info):
        self.calls.append("init")

    def start_weight_update(self):
        self.calls.append("start")

    def update_weights(self, update_info):
        self.calls.append(update_info["phase"])

    def finish_weight_update(self, weight_version=None):
        self.calls.append(f"finish {weight_version}")

    def pause(self, mode="wait"):
        self.calls.append("pause")

    def resume(self):
        self.calls.append("resume")

    def staged(self):
        self.calls.append("staged")
        self.polls -= 1
        done = self.polls <= 0
        return landing_ended([{"done": True, "error": None},
                              {"done": done, "error": self.error if done else None}])


def _refit(engine: Landing, timeout: float = 20.0):
    refit = RefitSpec.of(SPEC, SRC, reshard.VllmLayout(model=SPEC), install="loader", transport="inprocess",
                         staging="device")
    tensors = shard(SRC, {t.name: torch.randn(t.shape) for t in SPEC.tensors}, ranks=[0])[0]
    session = TrainerSession(refit, 0, tensors, engines=[engine], timeout=timeout, pause="wait", pause_for="flip",
                             lease=None)
    session.init()
    try:
        return session.refit("v1")
    finally:
        session.close()


def test_the_driver_pauses_only_after_every_worker_landed():
    engine = Landing(polls=3)
    result = _refit(engine)
    assert engine.calls[1:] == ["start", "transfer", "staged", "staged", "staged", "pause", "install", "finish v1",
                                "resume"]
    assert list(result.phases) == ["start", "transfer", "staged", "pause", "flip", "finish", "resume"]
    assert result.stats.pause_s < result.seconds - result.phases["staged"]


def test_a_landing_that_failed_ends_the_refit_before_any_pause():
    engine = Landing(polls=2, error="RuntimeError: injected")
    with pytest.raises(ExecutionError, match="previous weights: .*staged transfer failed before the flip: "
                                             "worker 1: RuntimeError: injected"):
        _refit(engine)
    assert "pause" not in engine.calls and "install" not in engine.calls and "finish None" in engine.calls


def test_a_landing_that_never_ends_is_bounded_by_the_refit_deadline():
    engine = Landing(polls=10 ** 9)
    with pytest.raises(ExecutionError, match="did not end by the refit's deadline"):
        _refit(engine, timeout=2.0)
    assert "pause" not in engine.calls and "install" not in engine.calls
