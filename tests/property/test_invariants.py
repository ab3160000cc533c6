"""The five invariants of every plan (../DESIGN: round trip, exactly-once coverage, accounting, determinism,
refusal of impossible layouts), over random small models and random valid topologies on both sides."""
from __future__ import annotations

import io
import json

import pytest
import torch
from hypothesis import given, strategies as st

import reshard
from reshard.errors import LayoutError
from reshard.executors import allocate, execute_local, shard
from reshard.planner import Plan
from reshard.testing.checks import data_bytes_by_rank, data_mask, write_counts
from reshard.testing.strategies import invalid_declarations, refits

SENTINEL = -7.0


def _weights(model: reshard.ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=g) for t in model.tensors}


FANOUT = st.sampled_from([None, None, 1, 2])


@given(refits(), st.integers(0, 2**16), st.booleans(), FANOUT)
def test_round_trip(pair, seed, colocated, fanout):
    """Source shards of random weights, run through the plan, equal the destination shards byte for byte;
    padding keeps what was there before. With fan-out trees too. The same plan compiled twice has one digest,
    and it and its layouts survive JSON round trips (determinism and persistence, on the same draws)."""
    src, dst = pair
    colocated = colocated and dst.num_ranks <= src.num_ranks
    plan = reshard.compile(src, dst, colocated=colocated, fanout=fanout)
    # determinism and persistence: same inputs, same digest; a plan survives JSON (never pickle) unchanged, and
    # layouts round-trip through their JSON too (test_npz_round_trip: .npz)
    assert reshard.compile(src, dst, colocated=colocated, fanout=fanout).digest == plan.digest
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.digest == plan.digest and again.accounting == plan.accounting
    assert type(src).model_validate_json(src.model_dump_json()) == src
    assert type(dst).model_validate_json(dst.model_dump_json()) == dst
    weights = _weights(src.model, seed)
    got = allocate(dst, fill=SENTINEL)
    execute_local(plan, shard(src, weights), got)
    want = shard(dst, weights, fill=SENTINEL)
    for rank, tensors in want.items():
        for name, expected in tensors.items():
            assert torch.equal(got[rank][name], expected), f"{dst} rank {rank} {name}"


@given(refits(), st.data(), FANOUT)
def test_exactly_once_coverage(pair, data, fanout):
    """Counting the ops' writes element by element gives 1 on model data and 0 elsewhere; also for subsets."""
    src, dst = pair
    names = None
    if data.draw(st.booleans()):
        pool = [t.name for t in src.model.tensors]
        names = set(data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=6, unique=True)))
    plan = reshard.compile(src, dst, tensors=names, fanout=fanout)
    counts = write_counts(plan)
    mask = data_mask(dst, names)
    for key, m in mask.items():
        c = counts.get(key, torch.zeros_like(m))
        assert torch.equal(c, m), f"{dst} rank {key[0]} {key[1]}: writes {c.flatten().tolist()[:20]}"


@given(refits(), st.data(), FANOUT)
def test_accounting(pair, data, fanout):
    src, dst = pair
    # not colocated, colocated rank for rank, or any source rank on each destination rank's device
    colocated = data.draw(st.sampled_from(["no", "same", "map"]))
    if colocated == "same" and dst.num_ranks <= src.num_ranks:
        colocated = True
    elif colocated == "map":
        colocated = data.draw(st.lists(st.integers(0, src.num_ranks - 1), min_size=dst.num_ranks,
                                       max_size=dst.num_ranks))
    else:
        colocated = False
    plan = reshard.compile(src, dst, colocated=colocated, fanout=fanout)
    mate = list(range(dst.num_ranks)) if colocated is True else colocated or None
    a, o = plan.accounting, plan.ops
    op_bytes = (o["rows"] * o["cols"]).sum() * src.model.itemsize
    assert a.total_bytes == op_bytes
    expected = data_bytes_by_rank(dst)
    assert list(a.ingress_bytes) == expected  # every destination receives exactly its share
    assert a.lower_bound_bytes == sum(expected) == a.total_bytes
    relayed = sum(a.relay_egress_bytes)
    assert sum(b for _, _, b in a.pair_bytes) + relayed == a.total_bytes
    assert sum(b for _, _, b in a.relay_pair_bytes) == relayed
    local = sum(b for s, d, b in a.pair_bytes if mate is not None and s == mate[d])
    assert a.local_bytes == local and sum(a.egress_bytes) == a.total_bytes - local - relayed
    if fanout:  # the trainer sends one replica's worth per root (less what EPLB slot copies feed); each replica
        # forwards at most fanout x what it got (slot copies aside: a rank may feed several redundant slots)
        per_replica = sum(expected[:dst.ranks_per_replica]) - a.slot_copy_bytes // dst.num_replicas
        assert sum(a.egress_bytes) + a.local_bytes == plan.roots * per_replica
        for r in range(dst.num_ranks):
            assert a.relay_egress_bytes[r] <= fanout * a.ingress_bytes[r] or a.slot_copy_bytes
    assert a.num_transfers == len(plan.transfers) == len(a.pair_bytes) + len(a.relay_pair_bytes)
    model_bytes = src.model.num_bytes
    assert a.model_bytes == model_bytes
    assert a.gather_broadcast_bytes >= model_bytes * dst.num_ranks


def test_npz_round_trip(tmp_path):
    model = reshard.ModelSpec.from_hf_config("examples/configs/qwen3-0.6b.json")
    plan = reshard.compile(reshard.MegatronLayout(model=model, tp=2, pp=2),
                           reshard.VllmLayout(model=model, tp=4, replicas=2))
    loaded = Plan.load(plan.save(tmp_path / "plan.npz"))
    assert loaded.digest == plan.digest and loaded.accounting == plan.accounting
    loaded = Plan.load(plan.save(tmp_path / "plan.json"))
    assert loaded.digest == plan.digest


@pytest.mark.parametrize("label,build,words", invalid_declarations(), ids=[c[0] for c in invalid_declarations()])
def test_invalid_layouts_are_refused(label, build, words):
    with pytest.raises(LayoutError) as info:
        build()
    for w in words:
        assert w in str(info.value), f"{label}: {info.value!r} lacks {w!r}"
    assert info.value.constraint and info.value.layout


@given(refits())
def test_valid_layouts_are_accepted_and_consistent(pair):
    """Invariant 5's other half: every generated layout constructs, and its placements fit its tensors."""
    for layout in pair:
        for rank in range(layout.num_ranks):
            shapes = layout.rank_tensors(rank)
            assert shapes, f"{layout} rank {rank} holds nothing"
        for t, p in ((t, p) for t in layout.model.tensors for p in layout.placements(t)):
            shape = layout.rank_tensors(p.rank)[p.tensor]
            lead = len(shape) - len(p.lengths)
            assert all(0 <= o < s for o, s in zip(p.phys_offset[:lead], shape[:lead]))
            assert all(o + n <= s for o, n, s in zip(p.phys_offset[lead:], p.lengths, shape[lead:])), (t.name, p)
