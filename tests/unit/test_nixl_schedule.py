"""The NIXL executor's schedule, without NIXL: every process's schedule of a random plan and binding is played
in one process (packing, each link's pieces copied sender -> receiver, arrival scatters, local copies, commit),
and the destination tensors must equal the local executor's byte for byte. Also: staged refits touch no
destination tensor before the commit, pieces are coalesced, and the packing rule."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import reshard
from reshard.errors import ExecutionError
from reshard.executors import allocate, execute_local, shard
from reshard.executors.binding import Binding
from reshard.executors.copies import DST, SHADOW, SRC, WIRE
from reshard.executors.nixl.options import NixlOptions
from reshard.executors.nixl.schedule import build_schedule, choose_direction
from reshard.executors.partition import Partition
from reshard.testing.strategies import refits
from harness.loopback import run_copies

SENTINEL = -7.0


@st.composite
def bound_plans(draw):
    """A random plan (fan-out trees and colocation included) with a random binding onto 1-4 processes."""
    src, dst = draw(refits())
    colocated = draw(st.booleans()) and dst.num_ranks <= src.num_ranks
    plan = reshard.compile(src, dst, colocated=colocated, fanout=draw(st.sampled_from([None, 1, 2])))
    procs = draw(st.integers(1, 4))
    binding = Binding(tuple(draw(st.lists(st.integers(0, procs - 1), min_size=src.num_ranks,
                                          max_size=src.num_ranks))),
                      tuple(draw(st.lists(st.integers(0, procs - 1), min_size=dst.num_ranks,
                                          max_size=dst.num_ranks))))
    options = NixlOptions(direction=draw(st.sampled_from(["auto", "read", "write"])), staged=draw(st.booleans()),
                          pack=draw(st.sampled_from(["auto", "always", "never"])),
                          pack_below=draw(st.sampled_from([None, 0, 64, 1 << 20])),
                          land_below=draw(st.sampled_from([None, 0, 256, 1 << 30])))
    return plan, binding, options


def _weights(model: reshard.ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=g) for t in model.tensors}


def play(plan, binding, options, src, dst):
    """Run every process's schedule in this process, in an order the real executor allows, up to the commit;
    return the schedules and the commit."""
    procs = range(binding.num_processes)
    sched = {p: build_schedule(plan, binding, p, options, *options.thresholds(False))
             for p in procs}
    arenas = {p: torch.zeros(sched[p].arena_numel) for p in procs}

    def memory_of(p):
        def memory(kind, ident):
            if kind == SRC:
                return src[plan.src_tensors.ranks[ident]][plan.src_tensors.names[ident]].view(-1)
            if kind == DST:
                return dst[plan.dst_tensors.ranks[ident]][plan.dst_tensors.names[ident]].view(-1)
            off, n = sched[p].arena[(kind, ident)]
            return arenas[p].narrow(0, off, n)
        return memory

    mem = {p: memory_of(p) for p in procs}
    links = {}
    for p in procs:
        for link in sched[p].outgoing:
            links[link.id] = link
    for s in range(plan.num_stages):
        for p in procs:
            run_copies(sched[p].local[s].rows_as_lists(), mem[p])
        for link in (l for l in links.values() if l.stage == s):
            send, recv = sched[link.sender], sched[link.receiver]
            if link.id in send.pack:
                run_copies(send.pack[link.id].rows_as_lists(), mem[link.sender])
            pc = link.pieces
            for sk, si, so, rk, ri, ro, n in zip(*(pc[c].tolist() for c in pc)):
                mem[link.receiver](rk, ri).narrow(0, ro, n).copy_(mem[link.sender](sk, si).narrow(0, so, n))
            if link.id in recv.arrive:
                run_copies(recv.arrive[link.id].rows_as_lists(), mem[link.receiver])

    def commit():
        for p in procs:
            run_copies(sched[p].commit.rows_as_lists(), mem[p])
    return sched, commit


@given(bound_plans(), st.integers(0, 2**16))
def test_schedules_played_together_equal_local_executor(case, seed):
    """...and a staged refit writes no destination tensor before its commit."""
    plan, binding, options = case
    weights = _weights(plan.src.model, seed)
    src = shard(plan.src, weights)
    want = allocate(plan.dst, fill=SENTINEL)
    execute_local(plan, src, want)
    got = allocate(plan.dst, fill=SENTINEL)
    sched, commit = play(plan, binding, options, src, got)
    if options.staged:
        for rank in got:
            for name, t in got[rank].items():
                assert bool((t == SENTINEL).all()), f"{binding} {options}: rank {rank} {name} written before commit"
    commit()
    for rank in want:
        for name in want[rank]:
            assert torch.equal(got[rank][name], want[rank][name]), f"{binding} {options}: rank {rank} {name}"
    # both ends of a link build the same link
    for p, s in sched.items():
        for link in s.incoming:
            twin = next(l for l in sched[link.sender].outgoing if l.id == link.id)
            for c in link.pieces:
                assert np.array_equal(link.pieces[c], twin.pieces[c])
            assert link.packed == twin.packed


@given(bound_plans())
def test_pieces_cover_each_link_once_and_are_coalesced(case):
    plan, binding, options = case
    link_of_op, _ = Partition(plan, binding, 0).streams
    nbytes = plan.op_bytes()
    for p in range(binding.num_processes):
        s = build_schedule(plan, binding, p, options, *options.thresholds(False))
        for link in s.incoming:
            pc = link.pieces
            assert int(pc["numel"].sum()) * plan.itemsize == int(nbytes[link_of_op == link.id].sum())
            direct = slice(0, link.num_pieces - 1) if link.packed else slice(None)
            if link.packed:  # one buffer for all packed ops, last
                assert pc["send_kind"][-1] == WIRE and pc["recv_kind"][-1] == WIRE
                assert pc["numel"][-1] == link.packed_numel > 0
                assert link.num_pieces < link.direct_pieces or options.pack == "always"
            landed = pc["recv_kind"][direct] == WIRE  # landed runs, each into the receive buffer
            assert set(pc["recv_kind"][direct][~landed].tolist()) <= {SHADOW if options.staged else DST}
            assert int(pc["numel"][direct][landed].sum()) == link.landed_numel
            if options.pack == "never":
                assert not link.packed and not link.landed_numel
            pc = {k: v[direct] for k, v in pc.items()}
            follows = ((pc["send_id"][1:] == pc["send_id"][:-1]) & (pc["recv_id"][1:] == pc["recv_id"][:-1])
                       & (pc["send_kind"][1:] == pc["send_kind"][:-1])
                       & (pc["send_off"][1:] == pc["send_off"][:-1] + pc["numel"][:-1])
                       & (pc["recv_off"][1:] == pc["recv_off"][:-1] + pc["numel"][:-1]))
            assert not follows.any(), "adjacent pieces were not coalesced"


def _strided_plan():
    spec = reshard.ModelSpec(family="qwen3", hidden_size=64, num_layers=1, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=100,
                             qk_norm=True)
    return reshard.compile(reshard.MegatronLayout(model=spec, tp=2), reshard.VllmLayout(model=spec, tp=1))


def test_small_pieces_are_packed_and_large_ones_move_direct():
    plan = _strided_plan()  # row-parallel weights split on columns: strided blocks of 32-element (128 B) rows
    binding = Binding((0, 1), (1,))
    every = build_schedule(plan, binding, 1, NixlOptions(), pack_below=1 << 20).incoming[0]
    assert every.num_pieces == 1 and every.packed_numel == every.numel and every.direct_pieces > 1
    none = build_schedule(plan, binding, 1, NixlOptions(), pack_below=8).incoming[0]
    assert not none.packed and none.num_pieces == none.direct_pieces > 1
    rows = build_schedule(plan, binding, 1, NixlOptions(), pack_below=129).incoming[0]  # only the 128 B rows
    o = plan.ops
    assert rows.packed and set(o["rows"][rows.packed_ops].tolist()) == {64}  # the strided blocks, 64 rows each
    assert int(o["rows"][np.setdiff1d(rows.ops, rows.packed_ops)].max()) == 1
    assert rows.num_pieces == 1 + len(np.setdiff1d(rows.ops, rows.packed_ops))


def test_direction_auto_balances_initiated_bytes():
    plan = _strided_plan()
    # two senders, one receiver: pushing spreads the copying over two processes
    assert choose_direction(plan, Binding((0, 1), (2,)), "auto") == "write"
    spec = plan.src.model
    fan = reshard.compile(reshard.MegatronLayout(model=spec), reshard.VllmLayout(model=spec, replicas=2))
    assert choose_direction(fan, Binding((0,), (1, 2)), "auto") == "read"
    assert choose_direction(fan, Binding((0,), (1, 2)), "write") == "write"


def test_bad_options_and_processes_are_refused():
    with pytest.raises(ExecutionError, match="direction='pull'"):
        NixlOptions(direction="pull")
    with pytest.raises(ExecutionError, match="timeout=0"):
        NixlOptions(timeout=0)
    plan = _strided_plan()
    with pytest.raises(ExecutionError, match="process 5 is outside"):
        build_schedule(plan, Binding((0, 1), (1,)), 5, NixlOptions(), 0)
    with pytest.raises(ExecutionError, match="2 source ranks, the binding places 1"):
        build_schedule(plan, Binding((0,), (1,)), 0, NixlOptions(), 0)
