"""Delta refits of the voted executors within one process (shared memory: every op local, payloads through no
wire, the store a real HashStore): each refit byte-equal to a dense refit of the same source, keyframes where the
policy says, a receiver that lost its version gets a keyframe; a DeltaState carries the protocol from one executor
to the next (integrations that make executors anew at every refit); a `delta` that is no DeltaPolicy is refused,
naming the option. The cross-process paths: tests/integration/test_voted_delta.py."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import reshard
from harness.refit_cases import tiny_spec
from reshard.errors import ArgumentError
from reshard.executors import allocate, execute_local, shard
from reshard.executors.binding import Binding
from reshard.executors.delta import DeltaPolicy, DeltaState
from reshard.executors.shared import SharedExecutor


def _plan():
    spec = tiny_spec().model_copy(update={"dtype": "bfloat16"})
    return reshard.compile(reshard.MegatronLayout(model=spec, tp=2), reshard.VllmLayout(model=spec, tp=1),
                           colocated=True)


def test_local_delta_refits_equal_dense_refits():
    plan = _plan()
    g = torch.Generator().manual_seed(3)
    weights = {t.name: torch.randn(t.shape, generator=g) for t in plan.src.model.tensors}
    src = shard(plan.src, weights)
    dst = allocate(plan.dst, fill=-7.0)
    ex = SharedExecutor(plan, Binding((0, 0), (0,)), 0, src, dst, store=dist.HashStore(), delta=DeltaPolicy(3))
    kinds = []
    for step in range(5):
        if step:
            for ts in src.values():
                for t in ts.values():
                    t.view(-1)[torch.rand(t.numel(), generator=g) < 0.05] += 1.0
        if step == 2:
            ex._delta.receiver.held = None  # lost its version: this refit must be a keyframe
        ex.refit()
        want = allocate(plan.dst, fill=-7.0)
        execute_local(plan, src, want)
        assert all(torch.equal(dst[r][n].view(torch.int16), want[r][n].view(torch.int16)) for r in dst for n in dst[r])
        report = ex.last_delta
        kinds.append(report.keyframe)
        if not report.keyframe:
            assert 0 < report.wire_bytes < report.dense_bytes, report
    assert kinds == [True, False, True, False, False]
    ex.close()


def test_a_delta_state_carries_the_protocol_from_one_executor_to_the_next():
    """An executor made anew for every refit (fresh store) adopts the state: a delta after the first refit; after
    `forget`, or with a new state, a keyframe; every refit byte-equal to a dense one."""
    plan = _plan()
    g = torch.Generator().manual_seed(4)
    src = shard(plan.src, {t.name: torch.randn(t.shape, generator=g) for t in plan.src.model.tensors})
    dst = allocate(plan.dst, fill=-7.0)
    state, kinds = DeltaState(), []
    for version in range(1, 7):
        if version > 1:
            for ts in src.values():
                for t in ts.values():
                    t.view(-1)[torch.rand(t.numel(), generator=g) < 0.05] += 1.0
        if version == 4:
            state.forget()
        ex = SharedExecutor(plan, Binding((0, 0), (0,)), 0, src, dst, store=dist.HashStore(),
                            delta=DeltaPolicy(16, state=DeltaState() if version == 6 else state))
        ex.refit(version)
        kinds.append(ex.last_delta.keyframe)
        ex.close()
        want = allocate(plan.dst, fill=-7.0)
        execute_local(plan, src, want)
        assert all(torch.equal(dst[r][n].view(torch.int16), want[r][n].view(torch.int16)) for r in dst for n in dst[r])
    assert kinds == [True, False, False, True, False, True]


def test_bad_delta_option_is_named():
    plan = _plan()
    src = shard(plan.src, {t.name: torch.zeros(t.shape) for t in plan.src.model.tensors})
    with pytest.raises(ArgumentError, match="delta"):
        SharedExecutor(plan, Binding((0, 0), (0,)), 0, src, allocate(plan.dst), store=dist.HashStore(),
                       delta=8)
