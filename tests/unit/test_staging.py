"""Staged refits (issue 40): the staging's memory is checked at init and refused with both sizes named; the flip
lands every staged byte; a driver with pause_for="flip" lets the engines generate while the bytes land and pauses
them only around the install, and reports the pause and the requests in flight; bad choices are refused."""
from __future__ import annotations

import pytest
import torch

import reshard
from reshard.adapters.refit import RefitSpec
from reshard.adapters.trainer import TrainerSession
from reshard.adapters.vllm.staging import Staging, check_room
from reshard.errors import ArgumentError, ExecutionError, PlanError
from reshard.executors import shard
from reshard.testing.megatron_cpu import TinyGPT

SPEC = reshard.ModelSpec.from_hf_config(TinyGPT().hf_config().to_dict())
SRC = reshard.MegatronLayout(model=SPEC, tp=1)


class Recorder:
    """An engine that records the calls it gets, in order (pausable, and it reports two requests in flight)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def in_flight(self) -> list[str]:
        self.calls.append("in_flight")
        return ["req-1", "req-2"]

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *a, **k: self.calls.append(name)


def _session(pause_for: str, staging: str | None = "device", **kwargs) -> tuple[TrainerSession, Recorder]:
    refit = RefitSpec.of(SPEC, SRC, reshard.VllmLayout(model=SPEC), install="loader", transport="inprocess",
                         staging=staging)
    tensors = shard(SRC, {t.name: torch.randn(t.shape) for t in SPEC.tensors}, ranks=[0])[0]
    engine = Recorder()
    return TrainerSession(refit, 0, tensors, engines=[engine], timeout=20.0, pause_for=pause_for, lease=None,
                          **kwargs), engine


def test_staging_that_cannot_fit_is_refused_naming_both_sizes():
    with pytest.raises(ExecutionError, match=r"needs 2\.00 GiB \(the shard\).*only 1\.00 GiB are free"):
        check_room(2 << 30, 1 << 30, "device", "the shard")
    huge = {"w": torch.empty(1 << 50, dtype=torch.uint8, device="meta")}  # a petabyte: no host has it free
    with pytest.raises(ExecutionError, match=r"staging='host' needs 1048576\.00 GiB \(one copy\)"):
        Staging(huge, "host", "one copy")
    with pytest.raises(ExecutionError, match="staging='gpu' is not one of"):
        Staging({"w": torch.zeros(1)}, "gpu", "x")


def test_the_flip_lands_every_staged_byte_and_only_then():
    live = {"a": torch.zeros(4, 3), "b": torch.zeros(7, dtype=torch.bfloat16)}
    staging = Staging(live, "device", "two tensors")
    assert staging.nbytes == 4 * 3 * 4 + 7 * 2
    for name, t in staging.tensors.items():
        t.copy_(torch.arange(t.numel()).view(t.shape))
    assert all(not t.any() for t in live.values())  # staged: the live tensors untouched
    staging.flip()
    assert all(torch.equal(live[n], staging.tensors[n]) for n in live)


def test_bad_choices_are_refused():
    with pytest.raises(ArgumentError, match="needs staged refits"):
        _session("flip", staging=None)
    with pytest.raises(ArgumentError, match="pause_for"):
        _session("transfer")
    with pytest.raises(ArgumentError, match="pause"):
        _session("flip", pause="sometimes")
    with pytest.raises(PlanError, match="staging='host'"):  # a loader install stages in its buffers
        RefitSpec.of(SPEC, SRC, reshard.VllmLayout(model=SPEC), install="loader", staging="host")


@pytest.mark.parametrize("pause_for", ["refit", "flip"])
def test_the_pause_spans_the_refit_or_only_the_flip(pause_for):
    session, engine = _session(pause_for, pause="keep")
    session.init()
    result = session.refit("v1")
    session.close()
    refit = ["init_weight_transfer_engine", "pause", "in_flight", "start_weight_update", "update_weights",
             "update_weights", "finish_weight_update", "resume"]
    flip = ["init_weight_transfer_engine", "start_weight_update", "update_weights", "staged", "pause", "in_flight",
            "update_weights", "finish_weight_update", "resume"]
    want = refit if pause_for == "refit" else flip  # (flip: the driver asks whether the bytes landed, then pauses)
    assert engine.calls[:len(want)] == want
    assert result.stats.in_flight == ("req-1", "req-2")
    assert 0 < result.stats.pause_s <= result.seconds
    if pause_for == "flip":
        assert list(result.phases) == ["start", "transfer", "staged", "pause", "flip", "finish", "resume"]
        assert result.stats.pause_s < result.seconds - result.phases["start"]


def test_only_keep_holds_requests_across_the_flip():
    session, engine = _session("flip", pause="wait")  # "wait" drained them: nothing to ask
    session.init()
    result = session.refit("v1")
    session.close()
    assert "in_flight" not in engine.calls and result.stats.in_flight == ()
