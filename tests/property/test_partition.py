"""executors.partition, the one split of a plan every executor runs on: for random plans and bindings, every op is
run by exactly one process (locally, or received from exactly one peer that sends it), and each transport's wire
schedule moves exactly the partition's ops between the partition's senders and receivers."""
from __future__ import annotations

import numpy as np
from hypothesis import given, strategies as st

from reshard.executors.nixl.options import NixlOptions
from reshard.executors.nixl.schedule import build_schedule as link_schedule
from reshard.executors.partition import Partition, carve
from reshard.executors.collective.schedule import build_schedule as round_schedule
from reshard.testing.strategies import refit_plans

from test_schedule import bindings


@st.composite
def cases(draw):
    plan = draw(refit_plans())
    return plan, draw(bindings(plan.src.num_ranks, plan.dst.num_ranks))


@given(cases())
def test_every_op_is_run_once_by_the_processes_the_binding_gives(case):
    plan, binding = case
    o = plan.ops
    parts = [Partition(plan, binding, p) for p in range(binding.num_processes)]
    landed = np.concatenate([np.concatenate([p.local, p.received]) for p in parts])
    assert sorted(landed.tolist()) == list(range(plan.num_ops))  # each op lands on exactly one process
    sent = np.concatenate([p.sent for p in parts])
    received = np.concatenate([p.received for p in parts])
    assert sorted(sent.tolist()) == sorted(received.tolist())  # each remote op leaves exactly one process
    for part in parts:
        p = part.process
        src_proc = np.where(o["src_side"] == 0, np.asarray(binding.src)[np.minimum(o["src_rank"], len(binding.src) - 1)],
                            np.asarray(binding.dst)[np.minimum(o["src_rank"], len(binding.dst) - 1)])
        assert np.array_equal(part.sender, src_proc)
        assert np.array_equal(part.receiver, np.asarray(binding.dst)[o["dst_rank"]])
        for q, ops in part.sends_to.items():  # what p sends q is what q receives from p
            assert q != p and np.array_equal(ops, parts[q].receives_from[p])
        assert part.local_numel + sum(part.bytes_received.values()) // plan.itemsize == part.numel(part.landing)
        stream, keys = part.streams  # one stream per (stage, sender, receiver) of remote ops, in that order
        remote = stream >= 0
        assert np.array_equal(remote, part.sender != part.receiver)
        assert np.array_equal(keys[stream[remote]], np.stack([o["stage"][remote], part.sender[remote],
                                                              part.receiver[remote]], axis=1))
        assert [tuple(k) for k in keys.tolist()] == sorted({tuple(k) for k in keys.tolist()})


@given(cases(), st.booleans())
def test_each_transport_moves_the_partition_s_ops_between_its_processes(case, staged):
    plan, binding = case
    for p in range(binding.num_processes):
        part = Partition(plan, binding, p)
        rounds = round_schedule(plan, binding, p, max(plan.num_ops, 1) * 64, staged)
        for way, want in (("sends", part.bytes_sent), ("recvs", part.bytes_received)):  # the wire carries them
            carried: dict[int, int] = {}
            for m in (m for r in rounds.rounds for m in getattr(r, way)):
                carried[m.peer] = carried.get(m.peer, 0) + m.numel
            assert carried == {q: n // plan.itemsize for q, n in want.items()}
        assert rounds.part.local_numel == part.local_numel
        assert {m.peer for r in rounds.rounds for m in r.sends} == set(part.sends_to)
        links = link_schedule(plan, binding, p, NixlOptions(staged=staged, direction="read"), 0)
        assert {lk.receiver: 0 for lk in links.outgoing}.keys() == part.sends_to.keys()
        assert {lk.sender for lk in links.incoming} == set(part.receives_from)
        assert sorted(np.concatenate([lk.ops for lk in links.incoming] or [np.zeros(0, np.int64)]).tolist()) == \
            part.received.tolist()
        assert sorted(np.concatenate([lk.ops for lk in links.outgoing] or [np.zeros(0, np.int64)]).tolist()) == \
            part.sent.tolist()
        for links_of, end, want in ((links.outgoing, "receiver", part.bytes_sent),
                                    (links.incoming, "sender", part.bytes_received)):
            carried = {}
            for lk in links_of:
                carried[getattr(lk, end)] = carried.get(getattr(lk, end), 0) + lk.numel * plan.itemsize
            assert carried == want
        assert links.part.peers == part.peers and links.part.local_numel == part.local_numel


@given(st.lists(st.integers(0, 1000), max_size=8), st.sampled_from([1, 8, 64]))
def test_arena_regions_are_aligned_and_apart(sizes, align):
    starts, total = carve(sizes, align)
    assert all(s % align == 0 for s in starts)
    ends = [s + max(n, 1) for s, n in zip(starts, sizes)]
    assert all(e <= s for e, s in zip(ends, starts[1:])) and (not sizes or ends[-1] <= total)
