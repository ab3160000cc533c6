"""TrainerSession.init refuses what would fail later: tensors that do not match the plan (before any engine is
called), an engine that cannot be reached (at once, not after the rendezvous's timeout)."""
from __future__ import annotations

import time

import pytest
import torch

import reshard
from reshard.adapters.lease_renewal import LeaseRenewal
from reshard.adapters.refit import RefitSpec
from reshard.adapters.server import VllmServer
from reshard.adapters.trainer import TrainerSession
from reshard.errors import ArgumentError, ExecutionError
from reshard.executors import shard
from reshard.polling import poll
from reshard.ports import free_port
from reshard.testing.megatron_cpu import TinyGPT
from harness.clock import OwnClock

SPEC = reshard.ModelSpec.from_hf_config(TinyGPT().hf_config().to_dict())


class Recorder:
    """An engine that records the calls it gets (init's checks must come before any)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *a, **k: self.calls.append(name)


def _tensors(src):
    return shard(src, {t.name: torch.randn(t.shape) for t in SPEC.tensors}, ranks=[0])[0]


@pytest.mark.parametrize("transport", ["inprocess", "collective"])
@pytest.mark.parametrize("spoil", ["shape", "missing", "dtype"])
def test_tensors_that_do_not_match_the_plan_are_refused_at_init(transport, spoil):
    src = reshard.MegatronLayout(model=SPEC, tp=1)
    refit = RefitSpec.of(SPEC, src, reshard.VllmLayout(model=SPEC), install="loader", transport=transport)
    tensors = _tensors(src)
    name = next(iter(tensors))
    if spoil == "shape":  # a shape that merely broadcasts to the planned one is no match either
        tensors[name] = tensors[name][:1].clone()
    elif spoil == "missing":
        del tensors[name]
    else:
        tensors[name] = tensors[name].double()
    engine = Recorder()
    session = TrainerSession(refit, 0, tensors, engines=[engine], timeout=20.0)
    with pytest.raises(ExecutionError, match="do not match the plan"):
        session.init()
    session.close()
    assert engine.calls == []


def test_an_unreachable_server_fails_init_at_once():
    port = free_port()  # nothing listens there
    src = reshard.MegatronLayout(model=SPEC, tp=1)
    refit = RefitSpec.of(SPEC, src, reshard.VllmLayout(model=SPEC), install="loader", transport="collective")
    session = TrainerSession(refit, 0, _tensors(src), engines=[VllmServer(f"http://127.0.0.1:{port}")],
                             timeout=120.0)
    t0 = time.monotonic()
    with pytest.raises(ExecutionError, match="refused|Connection"):
        session.init()
    session.close()
    assert time.monotonic() - t0 < 15, f"init failed only after {time.monotonic() - t0:.0f} s"


@pytest.mark.parametrize("lease", [0, 0.5, "30", True, float("nan"), 1e9])
def test_a_bad_lease_is_an_argument_error(lease):
    src = reshard.MegatronLayout(model=SPEC, tp=1)
    refit = RefitSpec.of(SPEC, src, reshard.VllmLayout(model=SPEC), install="loader", transport="inprocess")
    with pytest.raises(ArgumentError, match="lease"):
        TrainerSession(refit, 0, _tensors(src), lease=lease)


class LeasedEngine(Recorder):
    """An engine keeping a lease: it records when each grant came; the first grant takes `starting` seconds, as an
    engine still constructing its vLLM engine does."""

    def __init__(self, starting: float = 0.0) -> None:
        super().__init__()
        self.starting, self.grants = starting, []

    def acquire_lease(self, holder, ttl, timeout=None):
        if not self.grants:
            time.sleep(self.starting)
        self.grants.append(time.monotonic())

    def release_lease(self, timeout=None):
        pass


def test_the_lease_is_renewed_from_the_first_grant_while_a_slow_engine_starts():
    """A group whose last engine takes longer than the lease to answer its first grant (a replica still starting):
    the engines granted before it must be renewed meanwhile, not found lapsed at the first refit call.

    Renewed all through the slow start is what is asserted: a renewal that waited for the slow engine leaves the
    whole start (4 s) without a grant, where the 0.25 s cadence may stretch by a second or more when a loaded
    machine is slow to run the renewal thread (a gap near the 1 s lease would measure that, not the library)."""
    starting = 4.0
    src = reshard.MegatronLayout(model=SPEC)
    refit = RefitSpec.of(SPEC, src, reshard.VllmLayout(model=SPEC, tp=1), transport="inprocess")
    engines = [LeasedEngine(), LeasedEngine(), LeasedEngine(starting=starting)]
    session = TrainerSession(refit, 0, _tensors(src), engines=engines, lease=1.0)
    try:
        session._take_lease()
        time.sleep(0.6)
        for e in engines:
            points = [*e.grants, time.monotonic()]
            assert max(b - a for a, b in zip(points, points[1:])) < starting / 2, (e.grants, points[-1])
        assert len(engines[0].grants) >= 3 and len(engines[1].grants) >= 3
        # the last round's outcome counts (a renewal slow to answer under load, then renewed, is no error)
        assert poll(lambda: session.renewal.error is None, time.monotonic() + 10.0), session.renewal.error
    finally:
        session.close()


class SilentEngine(LeasedEngine):
    """Grants the first lease, then every renewal fails as a server too busy to answer would."""

    def acquire_lease(self, holder, ttl, timeout=None):
        if self.grants:
            raise ExecutionError("lease renewal: no answer within 1 s")
        super().acquire_lease(holder, ttl, timeout)


def test_a_failed_renewal_is_an_error_only_once_the_lease_may_have_lapsed():
    """A renewal round that fails inside the lease leaves the lease held (the engine still grants it; one whose lease
    lapses fences the driver itself): no error then. Once the last renewed round began a lease ago, the error says
    the lease may have lapsed and names the failure; a round renewed again clears it."""
    ttl = 3.0  # renewed every 0.75 s; the first failed round ends well inside the lease
    engine = SilentEngine()
    renewal = LeaseRenewal([], "driver0a", ttl)
    try:
        renewal.take([engine], 5.0)
        assert poll(lambda: renewal.failures["thread"] is not None, time.monotonic() + 10.0)
        assert renewal.error is None, "a round failed inside the lease: the lease still holds"
        assert poll(lambda: renewal.error is not None, time.monotonic() + 10.0)
        assert "may have lapsed" in renewal.error and "no answer within 1 s" in renewal.error, renewal.error
        renewal.engines.clear()  # (nothing left to renew: the next round renews all of it)
        assert poll(lambda: renewal.error is None, time.monotonic() + 10.0), renewal.error
    finally:
        renewal.stop()


class OrderedEngine(LeasedEngine):
    """Records when it is granted the lease, against when a NIXL agent is made."""

    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    def acquire_lease(self, holder, ttl, timeout=None):
        self.events.append("lease")
        super().acquire_lease(holder, ttl, timeout)


def test_the_nixl_agent_is_made_before_the_lease_is_taken(monkeypatch):
    """NIXL's import and UCX set-up hold the GIL for seconds on a loaded machine; the lease is renewed by a thread,
    so the driver makes its (real) agent before the first grant and its executor adopts that agent. The engine never
    joins the rendezvous here: init fails there, after the order was recorded."""
    pytest.importorskip("nixl")
    from reshard.executors.nixl import agent as nixl_agent

    events: list[str] = []
    made: dict[str, object] = {}
    real = nixl_agent._new_agent

    def recording(name, delay):
        events.append("agent")
        made[name] = real(name, delay)
        return made[name]

    monkeypatch.setattr(nixl_agent, "_new_agent", recording)
    src = reshard.MegatronLayout(model=SPEC, tp=1)
    refit = RefitSpec.of(SPEC, src, reshard.VllmLayout(model=SPEC), install="loader", transport="nixl")
    session = TrainerSession(refit, 0, _tensors(src), engines=[OrderedEngine(events)], timeout=2.0, lease=5.0)
    discard = nixl_agent.discard_ahead
    monkeypatch.setattr(nixl_agent, "discard_ahead", lambda name: None)  # kept, to check the executor would adopt it
    with pytest.raises(ExecutionError):
        session.init()
    session.close()
    assert events[:2] == ["agent", "lease"], events
    (name,) = made
    assert name == f"{session.refit_spec.rendezvous['refit_id']}:0"  # the executor's (adapters.refit, namespace)
    assert nixl_agent.make_agent(name, 1000) is made[name]  # what the executor's Connection would get
    discard(name)


def test_close_is_bounded_by_the_session_timeout(caplog):
    """A transport whose release never returns (waiting on a frozen peer) cannot hold close(): it returns after
    the session's timeout and says so in the log."""
    import threading

    class Stuck:
        def close(self):
            threading.Event().wait()

    src = reshard.MegatronLayout(model=SPEC, tp=1)
    refit = RefitSpec.of(SPEC, src, reshard.VllmLayout(model=SPEC), install="loader", transport="collective")
    session = TrainerSession(refit, 0, _tensors(src), timeout=1.0)
    session.executor = Stuck()
    clock = OwnClock()  # own time: a loaded machine's queueing for a CPU is not close's wait
    session.close()
    assert clock.seconds() < 3.0 and session.executor is None
    assert "did not finish within 1.0 s" in caplog.text
