"""Pieces of the distributed executor that need no processes: bindings, copy folding, bucket splitting, and the
executor itself in one process (everything local, as in E4)."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

import reshard
from reshard.errors import ExecutionError
from reshard.executors import RefitStats, allocate, execute_local, make_executor, shard
from reshard.executors.binding import Binding
from reshard.executors.copies import DST, SRC, fold
from reshard.executors.collective.executor import CollectiveExecutor, execute_collective
from reshard.executors.collective.runners import abort
from reshard.executors.collective.schedule import bucket_numel_for, build_schedule
from harness.loopback import run_copies, run_loopback

SPEC = reshard.ModelSpec(family="qwen3", hidden_size=16, num_layers=2, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=4, intermediate_size=24, vocab_size=100, qk_norm=True)


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=g) for t in SPEC.tensors}


# --- bindings ------------------------------------------------------------------------------------------
def test_binding_shapes_and_checks():
    assert Binding.disjoint(2, 3) == Binding((0, 1), (2, 3, 4))
    assert Binding.colocated(4, 2).processes == (0, 1, 2, 3)
    b = Binding((0, 0, 1), (1,))
    assert b.src_ranks_of(0) == (0, 1) and b.dst_ranks_of(1) == (0,)
    assert Binding.from_dict(b.to_dict()) == b and b.digest == Binding((0, 0, 1), (1,)).digest
    with pytest.raises(ExecutionError, match="non-negative"):
        Binding((0, -1), (0,))
    with pytest.raises(ExecutionError, match="plan has 2 source ranks, the binding places 1"):
        Binding((0,), (0,)).check(2, 1)
    with pytest.raises(ExecutionError, match="group has 2 ranks"):
        Binding.disjoint(2, 1).check(2, 1, group_size=2)


# --- folding -------------------------------------------------------------------------------------------
def test_interleaved_blocks_fold_into_one_strided_copy_per_kind():
    """Megatron's QKV interleave [q(4 rows) k v] per group -> vLLM's [q; k; v]: 3 copies for any group count."""
    groups, width = 8, 5
    q_rows, per_group = 4, 6
    so, do, rows = [], [], []
    for g in range(groups):
        base = g * per_group * width
        so += [base, base + q_rows * width, base + (q_rows + 1) * width]
        do += [g * q_rows * width, (groups * q_rows + g) * width, (groups * (q_rows + 1) + g) * width]
        rows += [q_rows, 1, 1]
    n = len(so)
    prog = fold(SRC, 0, np.array(so) , width, DST, 0, np.array(do), width, np.array(rows), width)
    assert len(prog) == 3
    src = torch.arange(groups * per_group * width, dtype=torch.float32)
    want, got = torch.zeros_like(src), torch.zeros_like(src)
    for s, d, r in zip(so, do, rows):
        want[d:d + r * width] = src[s:s + r * width]
    run_copies(prog.rows_as_lists(), lambda kind, i: src if kind == SRC else got)
    assert torch.equal(got, want) and n == 3 * groups


def test_fold_keeps_irregular_blocks_apart():
    so = np.array([0, 10, 13, 40])
    do = np.array([100, 0, 50, 7])
    prog = fold(SRC, 0, so, 3, DST, 0, do, 3, 1, 3)
    src = torch.arange(60, dtype=torch.float32)
    got, want = torch.zeros(200), torch.zeros(200)
    for s, d in zip(so, do):
        want[d:d + 3] = src[s:s + 3]
    run_copies(prog.rows_as_lists(), lambda kind, i: src if kind == SRC else got)
    assert torch.equal(got, want)


# --- buckets -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bucket", [1, 11, 37])
@pytest.mark.parametrize("staged", [True, False])
def test_tiny_buckets_split_ops_anywhere(bucket, staged):
    # one-element buckets on a few tensors (strided and contiguous), small ones on the whole model
    few = ["model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.down_proj.weight", "model.norm.weight"]
    plan = reshard.compile(reshard.MegatronLayout(model=SPEC, tp=2), reshard.VllmLayout(model=SPEC, replicas=2),
                           fanout=1, tensors=few if bucket == 1 else None)
    binding = Binding((0, 1), (1, 2))
    src = shard(plan.src, _weights())
    want, got = allocate(plan.dst, fill=-1.0), allocate(plan.dst, fill=-1.0)
    execute_local(plan, src, want)
    run_loopback(plan, binding, src, got, bucket, staged=staged)
    for r in want:
        for n in want[r]:
            assert torch.equal(got[r][n], want[r][n]), (r, n)
    for p in binding.processes:
        for rnd in build_schedule(plan, binding, p, bucket, staged).rounds:
            assert all(m.numel <= bucket for m in rnd.sends + rnd.recvs)


def test_bucket_size_respects_memory_cap():
    plan = reshard.compile(reshard.MegatronLayout(model=SPEC, tp=2), reshard.VllmLayout(model=SPEC, tp=2))
    b = Binding((0, 1), (1, 0))  # each process sends to and receives from the other: 2 buffers a round
    size = plan.itemsize
    assert bucket_numel_for(plan, b, memory_cap=4096, bucket_bytes=None, depth=2) * size * 2 * 2 == 4096
    assert bucket_numel_for(plan, b, memory_cap=1 << 30, bucket_bytes=1024, depth=2) == 1024 // size
    with pytest.raises(ExecutionError, match="memory_cap=4"):
        bucket_numel_for(plan, b, memory_cap=4, bucket_bytes=None, depth=2)


# --- one process ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("in_place", [False, True])
def test_one_process_plays_both_sides(in_place):
    """No process group: a colocated refit whose every byte is a local copy (E4), byte for byte."""
    plan = reshard.compile(reshard.MegatronLayout(model=SPEC, tp=2), reshard.VllmLayout(model=SPEC, replicas=2),
                           fanout=1)
    src = shard(plan.src, _weights(1))
    want, got = allocate(plan.dst, fill=-1.0), allocate(plan.dst, fill=-1.0)
    execute_local(plan, src, want)
    stats = execute_collective(plan, Binding((0, 0), (0, 0)), src, got, in_place=in_place)
    assert stats.rounds == 0 and stats.local_bytes == plan.accounting.total_bytes
    for r in want:
        for n in want[r]:
            assert torch.equal(got[r][n], want[r][n]), (r, n)


@pytest.mark.parametrize("name", ["reference", "inprocess", "collective"])
def test_every_executor_returns_one_stats_type(name):
    """Every executor's refit returns a RefitStats whose quantities agree with the plan's accounting."""
    plan = reshard.compile(reshard.MegatronLayout(model=SPEC, tp=2), reshard.VllmLayout(model=SPEC, tp=2))
    src, dst = shard(plan.src, _weights(1)), allocate(plan.dst, fill=-1.0)
    ex = make_executor(name, plan, Binding((0, 0), (0, 0)), 0, src, dst)
    first, second = ex.refit(), ex.refit(7)
    assert type(first) is RefitStats and first.executor == name and first.process == 0
    assert (first.version, second.version) == (1, 7)
    assert first.ops == plan.num_ops and first.local_bytes == plan.accounting.total_bytes
    assert first.bytes_sent == {} and first.seconds >= sum(first.phases.values()) * 0.999 > 0


def test_bad_tensors_are_refused_before_anything_moves():
    plan = reshard.compile(reshard.MegatronLayout(model=SPEC), reshard.VllmLayout(model=SPEC))
    ex = CollectiveExecutor(plan, Binding((0,), (0,)))
    src = shard(plan.src, _weights())
    dst = allocate(plan.dst, fill=-1.0)
    name = next(iter(dst[0]))
    bad = {0: {**dst[0], name: dst[0][name].double()}}
    with pytest.raises(ExecutionError, match=f"{name}.*nothing was moved"):
        ex.refit(src=src, dst=bad)
    assert all(bool((t == -1).all()) for t in dst[0].values())
    with pytest.raises(ExecutionError, match=r"destination ranks given \[\]"):
        ex.refit(src=src, dst={})
    with pytest.raises(ExecutionError, match="group rank 1 but the group has 1 ranks"):
        CollectiveExecutor(plan, Binding((0,), (1,)))


def test_repeated_calls_skip_checks_only_for_the_same_tensors():
    """A call with the very tensors of the last good call skips the checks; any other tensor is checked again."""
    plan = reshard.compile(reshard.MegatronLayout(model=SPEC), reshard.VllmLayout(model=SPEC))
    ex = CollectiveExecutor(plan, Binding((0,), (0,)), in_place=True)
    src = shard(plan.src, _weights())
    want, dst = allocate(plan.dst, fill=-1.0), allocate(plan.dst, fill=-1.0)
    execute_local(plan, src, want)
    ex.refit(src=src, dst=dst)
    assert ex._kept.given, "a good call arms the fast path"
    name = next(iter(dst[0]))
    dst[0][name] = dst[0][name].double()  # the same dict, one tensor swapped for a bad one
    with pytest.raises(ExecutionError, match=f"{name}.*nothing was moved"):
        ex.refit(src=src, dst=dst)
    dst[0][name] = torch.full(want[0][name].shape, -1.0, dtype=want[0][name].dtype)  # a new, good tensor
    ex.refit(src=src, dst=dst)
    ex.refit(src=src, dst=dst)  # the fast path, on the tensors just checked
    for n in want[0]:
        assert torch.equal(dst[0][n], want[0][n]), n


class _Communicator:
    """A group whose abort returns only once every group's abort has begun: NCCL's abort frees buffers, which
    waits for the kernels of every communicator, and a kernel returns only once its own abort has begun."""

    def __init__(self, everyone: threading.Barrier | None) -> None:
        self.everyone, self.aborted = everyone, False

    def abort(self) -> None:
        if self.everyone is None:
            time.sleep(30)  # never finishes within the test
            return
        self.everyone.wait()
        self.aborted = True


def test_abort_aborts_every_lane_at_once_and_gives_up_after_the_timeout():
    everyone = threading.Barrier(3, timeout=10)
    lanes = [_Communicator(everyone) for _ in range(3)]
    start = time.monotonic()
    assert abort(lanes, timeout=5.0) == [] and all(c.aborted for c in lanes)  # one after another: deadlock
    stuck = _Communicator(None)
    assert abort([_Communicator(threading.Barrier(1)), stuck], timeout=0.2) == [stuck]
    assert time.monotonic() - start < 5.0


def test_an_abort_that_does_not_finish_is_named_and_the_process_still_raises(monkeypatch):
    import reshard.executors.collective.executor as distributed

    plan = reshard.compile(reshard.MegatronLayout(model=SPEC), reshard.VllmLayout(model=SPEC))
    calls = []
    monkeypatch.setattr(distributed, "abort", lambda groups, timeout: (calls.append(len(groups)), groups[1:])[1])
    ex = CollectiveExecutor(plan, Binding((0,), (0,)), timeout=0.2)
    lanes = [object(), object(), object()]  # as if three lanes had been made
    monkeypatch.setattr(CollectiveExecutor, "lanes", property(lambda self: lanes if self is ex else [None]))
    note = ex.abort()
    assert "2 of the 3 communicators (lanes) did not finish within 0.2 s: restart this process" in note
    assert ex.abort() == note and calls == [3]  # aborted once
    one = CollectiveExecutor(plan, Binding((0,), (0,)), timeout=0.2)
    assert one.abort() == "" and calls == [3, 1]


def test_first_uses_of_a_communicator_run_off_thread_and_are_bounded():
    """NCCL blocks the host while it connects to a gone peer; the executor's first uses must still time out."""
    from reshard.executors.collective.connect import off_thread

    cpu = torch.device("cpu")
    assert off_thread(lambda: 7, 1.0, cpu, "x") == 7
    with pytest.raises(ValueError, match="boom"):  # the helper's error reaches the caller
        off_thread(lambda: (_ for _ in ()).throw(ValueError("boom")), 1.0, cpu, "x")
    start = time.monotonic()
    with pytest.raises(ExecutionError, match="connecting to peers did not return within 0.2 s"):
        off_thread(lambda: time.sleep(30), 0.2, cpu, "connecting to peers")
    assert time.monotonic() - start < 5.0
