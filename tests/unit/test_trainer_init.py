"""TrainerSession.init refuses what would fail later: tensors that do not match the plan (before any engine is
called), an engine that cannot be reached (at once, not after the rendezvous's timeout)."""
from __future__ import annotations

import socket
import time

import pytest
import torch

import reshard
from reshard.adapters.refit import RefitSpec
from reshard.adapters.server import VllmServer
from reshard.adapters.trainer import TrainerSession
from reshard.errors import ArgumentError, ExecutionError
from reshard.executors import shard
from reshard.testing.megatron_cpu import TinyGPT

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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
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
