"""TrainerSession's timeout bounds the whole refit, not each step: an engine that freezes after init (every call
blocks, as a SIGSTOPped server's HTTP calls do) ends the refit with ExecutionError within the timeout, where
bounding each step (pause, closing the failed update, resume: three waits) took three times as long. The clean-up
left running goes on in the background, in order, and the next refit waits for it before its first call."""
from __future__ import annotations

import threading

import pytest
import torch

import reshard
from reshard.adapters.refit import RefitSpec
from reshard.adapters.trainer import TrainerSession
from reshard.errors import ExecutionError
from reshard.executors import shard
from reshard.testing.megatron_cpu import TinyGPT
from harness.clock import OwnClock

SPEC = reshard.ModelSpec.from_hf_config(TinyGPT().hf_config().to_dict())
TIMEOUT = 3.0
MARGIN = 2.0  # thread start-up and joins after the deadline; one step more would add TIMEOUT


class FreezingEngine:
    """An engine client (vLLM's weight-sync methods, pause / resume) that answers at once until `freeze()`; then
    every call blocks until `thaw()`. It records each call as it enters, in order."""

    def __init__(self) -> None:
        self.entered: list[tuple[str, object]] = []
        self.running = threading.Event()
        self.running.set()

    def freeze(self) -> None:
        self.running.clear()

    def thaw(self) -> None:
        self.running.set()

    def _call(self, name: str, arg: object = None) -> None:
        self.entered.append((name, arg))
        self.running.wait()

    def init_weight_transfer_engine(self, info):
        self._call("init")

    def pause(self, mode="wait"):
        self._call("pause")

    def resume(self):
        self._call("resume")

    def start_weight_update(self):
        self._call("start")

    def update_weights(self, info):
        self._call("update", info.get("phase"))

    def finish_weight_update(self, version=None):
        self._call("finish", version)


def _session(engine: FreezingEngine) -> TrainerSession:
    src = reshard.MegatronLayout(model=SPEC, tp=1)
    refit = RefitSpec.of(SPEC, src, reshard.VllmLayout(model=SPEC), install="loader", transport="inprocess")
    tensors = shard(src, {t.name: torch.randn(t.shape) for t in SPEC.tensors}, ranks=[0])[0]
    return TrainerSession(refit, 0, tensors, engines=[engine], timeout=TIMEOUT, lease=None)


def test_a_frozen_engine_ends_the_refit_within_its_timeout():
    engine = FreezingEngine()
    session = _session(engine)
    session.init()
    assert session.refit("v1").version == "v1"  # answering: the whole refit, resume included
    engine.freeze()
    before = len(engine.entered)
    clock = OwnClock()  # own time: a loaded machine's queueing for a CPU is not the refit's wait
    with pytest.raises(ExecutionError, match="deadline") as e:
        session.refit("v2")
    took = clock.seconds()
    assert took < TIMEOUT + MARGIN, f"a {TIMEOUT:.0f} s refit against a frozen engine took {took:.1f} s"
    assert "goes on in the background" in str(e.value)
    engine.thaw()  # the engine answers again: what was left ends, in order, before the next refit's first call
    result = session.refit("v3")
    assert engine.entered[before:] == [
        ("pause", None),  # v2: frozen here; by the deadline the refit raised, its wind-down went on
        ("finish", None), ("resume", None),  # the wind-down: the failed update closed, then resumed
        ("pause", None), ("start", None), ("update", "transfer"), ("update", "install"), ("finish", "v3"),
        ("resume", None)]  # v3, after the wind-down ended
    assert result.version == "v3"
    session.close()


def test_a_refit_that_waits_for_an_earlier_wind_down_is_bounded_too():
    """A second refit against the still frozen engine: it waits for the first one's clean-up, at most its own
    timeout, and raises without calling the engine."""
    engine = FreezingEngine()
    session = _session(engine)
    session.init()
    engine.freeze()
    with pytest.raises(ExecutionError):
        session.refit("v1")
    calls = len(engine.entered)
    clock = OwnClock()
    with pytest.raises(ExecutionError, match="previous refit's clean-up"):
        session.refit("v2")
    assert clock.seconds() < TIMEOUT + MARGIN
    # v2 called nothing: what entered since v1 raised is v1's wind-down (closing the update, then resume)
    assert all(c in (("finish", None), ("resume", None)) for c in engine.entered[calls:]), engine.entered[calls:]
    engine.thaw()
    session.close()
