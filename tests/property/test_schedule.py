"""The distributed executor's wire schedule, run for every process in one process (harness.loopback): random
plans, random bindings of plan ranks to processes, random bucket sizes; byte-identical to `execute_local`."""
from __future__ import annotations

import torch
from hypothesis import given, strategies as st

from reshard.executors import allocate, execute_local, shard
from reshard.executors.binding import Binding
from reshard.executors.collective.schedule import build_schedule
from harness.loopback import run_loopback
from reshard.testing.strategies import refit_plans

SENTINEL = -7.0


@st.composite
def bindings(draw, num_src: int, num_dst: int) -> Binding:
    """Disjoint, colocated, or any mapping of plan ranks onto 1-4 processes."""
    shape = draw(st.sampled_from(["disjoint", "colocated", "random"]))
    if shape == "disjoint":
        return Binding.disjoint(num_src, num_dst)
    if shape == "colocated" and num_dst <= num_src:
        return Binding.colocated(num_src, num_dst)
    procs = draw(st.integers(1, 4))
    return Binding(tuple(draw(st.lists(st.integers(0, procs - 1), min_size=num_src, max_size=num_src))),
                   tuple(draw(st.lists(st.integers(0, procs - 1), min_size=num_dst, max_size=num_dst))))


@st.composite
def cases(draw):
    plan = draw(refit_plans())
    binding = draw(bindings(plan.src.num_ranks, plan.dst.num_ranks))
    # small buckets split ops at odd places; at most ~30 buckets a stream keeps examples fast
    total = int((plan.ops["rows"] * plan.ops["cols"]).sum())
    bucket = max(draw(st.sampled_from([1, 3, 7, 64, 1000, 1 << 20])), total // 30)
    direct = draw(st.sampled_from([1, 5, 100, 1 << 40]))  # runs sent unpacked: all, most, some, none
    return plan, binding, bucket, draw(st.booleans()), draw(st.integers(0, 2**16)), direct


def _inputs(plan, seed):
    g = torch.Generator().manual_seed(seed)
    weights = {t.name: torch.randn(t.shape, generator=g) for t in plan.src.model.tensors}
    return shard(plan.src, weights), allocate(plan.dst, fill=SENTINEL)


@given(cases(), st.data())
def test_loopback_equals_local(case, data):
    plan, binding, bucket, staged, seed, direct = case
    src, want = _inputs(plan, seed)
    execute_local(plan, src, want)
    got = allocate(plan.dst, fill=SENTINEL)
    undo = not staged and data.draw(st.booleans())  # in place, keeping the previous bytes
    run_loopback(plan, binding, src, got, bucket, staged=staged, direct_numel=direct, undo=undo)
    for rank, tensors in want.items():
        for name, expected in tensors.items():
            assert torch.equal(got[rank][name], expected), f"{binding} bucket={bucket} rank {rank} {name}"


@given(cases(), st.data())
def test_staged_refit_cut_short_leaves_destinations_unchanged(case, data):
    plan, binding, bucket, _, seed, direct = case
    src, _ = _inputs(plan, seed)
    got = allocate(plan.dst, fill=SENTINEL)
    cut = []
    undo = data.draw(st.booleans())  # staged, or written in place and put back
    run_loopback(plan, binding, src, got, bucket, staged=not undo, undo=undo, direct_numel=direct,
                 fail_at=lambda rounds: cut.append(data.draw(st.sampled_from(rounds))) or cut[0])
    if not cut:
        return  # nothing crosses processes: the refit cannot be cut short
    for rank, tensors in got.items():
        for name, t in tensors.items():
            assert bool((t == SENTINEL).all()), f"rank {rank} {name} was written before commit"


@given(cases())
def test_schedule_accounts_every_byte(case):
    """Messages carry exactly the plan's remote bytes, each bucket at most the bucket size; no self-sends."""
    plan, binding, bucket, staged, _, direct = case
    o = plan.ops
    numel = o["rows"] * o["cols"]
    sent, received, local = {}, {}, 0
    for p in binding.processes:
        s = build_schedule(plan, binding, p, bucket, staged, direct)
        for r in s.rounds:
            for m in r.sends + r.recvs:
                assert m.peer != p and 0 < m.numel <= bucket
                assert m.copies.numel == m.numel
            for msgs in (r.sends, r.recvs):  # a peer's messages of one round share its bucket, without overlap
                for peer in {m.peer for m in msgs}:
                    spans = sorted((m.offset, m.offset + m.numel) for m in msgs if m.peer == peer)
                    assert spans[-1][1] <= bucket
                    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        for peer, ops in s.part.sends_to.items():
            sent[(p, peer)] = s.part.numel(ops)
        for peer, ops in s.part.receives_from.items():
            received[(peer, p)] = s.part.numel(ops)
        local += s.part.local_numel
    assert sent == received
    expected = {}
    for i in range(plan.num_ops):
        a = (binding.src if o["src_side"][i] == 0 else binding.dst)[o["src_rank"][i]]
        b = binding.dst[o["dst_rank"][i]]
        if a != b:
            expected[(a, b)] = expected.get((a, b), 0) + int(numel[i])
    assert sent == expected
    assert local + sum(sent.values()) == int(numel.sum())
