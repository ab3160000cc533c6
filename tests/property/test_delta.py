"""Delta refits (executors.delta, planner.delta) over random layouts and change patterns (nothing, one element,
every element, a clustered run, random elements): after a delta refit the destination equals a dense refit of the
same source (the reference executor); the encoded ops write every changed element exactly once and no other
element (proven from the encoding, and seen: elements the encoding does not write keep a poison value); a delta on
the wrong base version, with an index out of its box, an op it does not receive, or larger than the dense block
it replaces is refused, naming it, with nothing written."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

import reshard
from reshard.errors import ArgumentError, CoverageError
from reshard.executors import allocate, execute_local, make_executor, shard
from reshard.executors.delta import DeltaError, DeltaPolicy, Receiver, Sender, _sections
from reshard.planner.plan import RELAY
from reshard.planner.delta import DENSE, SPARSE, DeltaOps, prove_delta
from reshard.testing.strategies import refits

from harness.delta_written import wire_bytes, written

PATTERNS = ("empty", "one", "all", "clustered", "random")
POISON = -7.0


def _changed(weights: dict, pattern: str, g: torch.Generator) -> dict:
    """New canonical weights: `weights` with the pattern's elements changed (each to a value with other bits)."""
    out = {k: v.clone() for k, v in weights.items()}
    names = sorted(out)
    if pattern == "empty":
        return out
    if pattern == "all":
        return {k: v + 1.0 for k, v in out.items()}
    name = names[int(torch.randint(len(names), (1,), generator=g))]
    flat = out[name].view(-1)
    if pattern == "one":
        flat[int(torch.randint(flat.numel(), (1,), generator=g))] += 1.0
    elif pattern == "clustered":
        a = int(torch.randint(flat.numel(), (1,), generator=g))
        flat[a:a + 37] += 1.0
    else:
        for k, v in out.items():
            mask = torch.rand(v.shape, generator=g) < 0.05
            v[mask] += 1.0
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.int32 if t.element_size() == 4 else torch.int16)


def _copy_into(tensors: dict, new: dict) -> None:
    for r, ts in tensors.items():
        for n, t in ts.items():
            t.copy_(new[r][n])


@settings(max_examples=40, deadline=None)
@given(refits(), st.sampled_from(PATTERNS), st.integers(0, 2**16))
def test_delta_refit_equals_dense_and_writes_each_changed_element_once(pair, pattern, seed):
    src, dst = pair
    plan = reshard.compile(src, dst)
    assume(not (plan.ops["src_side"] == RELAY).any())  # redundant expert slots relayed: the in-process executor refuses
    g = torch.Generator().manual_seed(seed)
    w0 = {t.name: torch.randn(t.shape, generator=g) for t in src.model.tensors}
    w1 = _changed(w0, pattern, g)
    source, got = shard(src, w0), allocate(dst, fill=POISON)
    ex = make_executor("inprocess", plan, None, 0, source, got, delta=DeltaPolicy(keyframe_every=4))
    assert ex.refit().version == 1 and ex.last_delta.keyframe
    before, after = allocate(dst, fill=POISON), allocate(dst, fill=POISON)
    execute_local(plan, source, before)
    _copy_into(source, shard(src, w1))
    execute_local(plan, source, after)

    # the encoding, as the executor makes it: proven, and its writes are exactly the changed elements
    sender = ex._sender
    payload, delta = sender.encode(ex._mine, 2, ex._src_flat)
    prove_delta(plan, delta, ex._mine)
    tid, pos = written(plan, delta)
    table = plan.dst_tensors
    key = tid * (1 << 40) + pos
    assert len(np.unique(key)) == len(key), "an element written twice"
    changed = set()
    for i, (r, n) in enumerate(zip(table.ranks, table.names)):
        diff = torch.nonzero(_bits(before[r][n]) != _bits(after[r][n])).view(-1).numpy()
        changed.update((i * (1 << 40) + diff).tolist())
    dense_ops = np.repeat(delta.encoding == DENSE, np.where(delta.encoding == DENSE,
                          plan.ops["rows"][delta.op] * plan.ops["cols"][delta.op], delta.count))
    assert changed <= set(key.tolist()), "a changed element not written"
    assert set(key[~dense_ops].tolist()) <= changed, "an unchanged element written by a sparse or bitmap op"
    if pattern == "empty":
        assert len(delta) == 0
    assert payload.numel() <= max(wire_bytes(plan, delta), 1) + 8 * 8 + 24 * len(delta) + 8 * 4

    # the executor's delta refit: poison everything it does not write, then it lands what the dense refit lands
    for i, (r, n) in enumerate(zip(table.ranks, table.names)):
        flat = got[r][n].view(-1)
        keep = torch.ones(flat.numel(), dtype=torch.bool)
        keep[torch.from_numpy(pos[tid == i])] = False
        flat[keep] = POISON
    stats = ex.refit()
    report = ex.last_delta
    assert report.base == 1 and report.version == 2 and stats.local_bytes == report.wire_bytes
    for i, (r, n) in enumerate(zip(table.ranks, table.names)):
        flat, want = got[r][n].view(-1), after[r][n].view(-1)
        hit = torch.zeros(flat.numel(), dtype=torch.bool)
        hit[torch.from_numpy(pos[tid == i])] = True
        assert torch.equal(_bits(flat[hit]), _bits(want[hit])), (str(dst), r, n)
        assert bool((flat[~hit] == POISON).all()), f"an element the delta does not write was touched: {r} {n}"


def _tiny(dtype: str = "bfloat16"):
    spec = reshard.ModelSpec(family="qwen3", hidden_size=16, num_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=4, intermediate_size=24, vocab_size=100, qk_norm=True,
                             dtype=dtype)
    return reshard.compile(reshard.MegatronLayout(model=spec, tp=2), reshard.VllmLayout(model=spec, tp=1))


def _one_change():
    """A plan, its source after a keyframe with one element changed, a sender at base 1, a receiver at 1."""
    plan = _tiny()
    g = torch.Generator().manual_seed(0)
    w = {t.name: torch.randn(t.shape, generator=g).to(torch.bfloat16) for t in plan.src.model.tensors}
    source, target = shard(plan.src, w), allocate(plan.dst)
    execute_local(plan, source, target)
    ops = np.arange(plan.num_ops)
    from reshard.executors.partition import Prepared

    prep = Prepared(plan, source, target)
    sender = Sender(plan, ops)
    sender.committed(1, prep.src_flat, keyframe=True)
    big = int(np.argmax(plan.ops["rows"] * plan.ops["cols"]))
    s = plan.ops
    source[int(s["src_rank"][big])][plan.src_tensors.names[int(s["src_tensor"][big])]].view(-1)[
        int(s["src_offset"][big]) + 1] += 1.0
    receiver = Receiver(plan)
    receiver.held = 1
    return plan, prep, sender, receiver, target, ops


def _unchanged(target: dict, snapshot: dict) -> bool:
    return all(torch.equal(target[r][n], snapshot[r][n]) for r in target for n in target[r])


def test_refusals_name_the_problem_and_write_nothing():
    plan, prep, sender, receiver, target, ops = _one_change()
    snapshot = {r: {n: t.clone() for n, t in ts.items()} for r, ts in target.items()}
    payload, delta = sender.encode(ops, 2, prep.src_flat)
    assert list(delta.encoding) == [SPARSE] and list(delta.count) == [1]

    receiver.held = 3  # the engine holds another version than the delta's base
    with pytest.raises(DeltaError, match=r"computed against version 1, but the engine holds version 3"):
        receiver.read(payload, ops)
    receiver.held = None
    with pytest.raises(DeltaError, match=r"holds no version"):
        receiver.read(payload, ops)
    receiver.held = 1

    at = _sections(plan, delta.op, delta.encoding, delta.count, 0)
    box = int(plan.ops["rows"][delta.op[0]] * plan.ops["cols"][delta.op[0]])
    bad = payload.clone()
    bad[at["index"]:at["index"] + 4] = torch.tensor([box], dtype=torch.int32).view(torch.uint8)
    with pytest.raises(DeltaError, match=f"index {box} outside its box of {box} elements"):
        receiver.read(bad, ops)
    with pytest.raises(DeltaError, match="not one of the ops this receiver gets"):
        receiver.read(payload, np.setdiff1d(ops, delta.op))
    bloated = payload.clone()  # the entry claims every element of its box changed, sparse: larger than dense
    entry = bloated[at["entries"]:at["digest"]].view(torch.int64)
    entry[2] = box
    with pytest.raises(DeltaError, match="is not smaller than the dense block it replaces"):
        receiver.read(bloated, ops)
    with pytest.raises(DeltaError, match="its entries need"):
        receiver.read(payload[:-8], ops)
    with pytest.raises(DeltaError, match="malformed"):
        receiver.read(payload[:16], ops)
    assert _unchanged(target, snapshot)

    receiver.apply(receiver.read(payload, ops), prep.dst_flat)  # the good one lands
    assert not _unchanged(target, snapshot)


def test_delta_proof_refuses_forged_entries():
    plan = _tiny()
    box = int(plan.ops["rows"][0] * plan.ops["cols"][0])
    with pytest.raises(CoverageError, match="appears twice"):
        prove_delta(plan, DeltaOps([0, 0], [SPARSE, SPARSE], [1, 1], [0, 1]))
    with pytest.raises(CoverageError, match="not strictly increasing"):
        prove_delta(plan, DeltaOps([0], [SPARSE], [2], [1, 1]))
    with pytest.raises(CoverageError, match="index -1 outside its box"):  # an entry's first index
        prove_delta(plan, DeltaOps([0], [SPARSE], [2], [-1, 0]))
    with pytest.raises(CoverageError, match=f"index {box} outside its box"):  # an entry's last index
        prove_delta(plan, DeltaOps([0], [SPARSE], [2], [0, box]))
    with pytest.raises(CoverageError, match="dense entry of 1 elements"):
        prove_delta(plan, DeltaOps([0], [DENSE], [1], []))
    with pytest.raises(CoverageError, match="not an op of the plan"):
        prove_delta(plan, DeltaOps([plan.num_ops], [SPARSE], [1], [0]))
    prove_delta(plan, DeltaOps([0], [SPARSE], [1], [box - 1]))


@settings(max_examples=200)
@given(data=st.data(), chunk=st.sampled_from([1, 2, 7, 1 << 26]))
def test_index_proof_equals_a_check_entry_by_entry(data, chunk):
    """prove_delta checks the indices of all entries at once, in chunks (first and last against the box, the rise
    within entries); its verdict equals checking each entry's indices alone, whatever the chunk."""
    import reshard.planner.delta as planner_delta

    plan = _tiny()
    box = plan.ops["rows"] * plan.ops["cols"]
    small = np.flatnonzero(box >= 64)  # ops where a few changed elements encode smaller than the block
    ops = np.sort(data.draw(st.lists(st.sampled_from(small.tolist()), min_size=1, max_size=4, unique=True)))
    parts = [sorted(data.draw(st.sets(st.integers(0, int(box[op]) - 1), min_size=1, max_size=int(box[op]) // 40)))
             for op in ops]
    index = np.concatenate(parts)
    counts = [len(p) for p in parts]
    ends = np.cumsum(counts)
    edges = sorted({0, *ends[:-1].tolist(), *(ends - 1).tolist()})  # entries' first and last indices
    for _ in range(data.draw(st.integers(0, 2))):  # forge some: at entries' edges, just outside a box, repeats
        at = data.draw(st.sampled_from(edges)) if data.draw(st.booleans()) else data.draw(
            st.integers(0, len(index) - 1))
        edge = int(box[ops[np.searchsorted(ends, at, side="right")]])
        index[at] = data.draw(st.sampled_from([-1, edge - 1, edge, edge + 1, int(index[at - 1])])) if data.draw(
            st.booleans()) else data.draw(st.integers(-2, int(box[ops].max()) + 2))
    entry_ok = all(((seg >= 0) & (seg < box[op])).all() and (np.diff(seg) > 0).all()
                   for op, seg in zip(ops, np.split(index, ends[:-1])))
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(planner_delta, "PROOF_CHUNK", chunk)
            prove_delta(plan, DeltaOps(ops, [SPARSE] * len(ops), counts, index))
        proven = True
    except CoverageError as e:
        proven = False
        assert all("outside its box" in p or "not strictly increasing" in p for p in e.problems), e.problems
    assert proven == entry_ok


def test_policy_keyframes_and_option_checks():
    plan = _tiny()
    g = torch.Generator().manual_seed(1)
    w = {t.name: torch.randn(t.shape, generator=g).to(torch.bfloat16) for t in plan.src.model.tensors}
    source, got = shard(plan.src, w), allocate(plan.dst)
    ex = make_executor("inprocess", plan, None, 0, source, got, delta=DeltaPolicy(keyframe_every=3),
                       checksum="sha256")
    dense = make_executor("inprocess", plan, None, 0, source, allocate(plan.dst), checksum="sha256")
    kinds = []
    for _ in range(7):
        for ts in source.values():
            for t in ts.values():
                t.view(-1)[::17] += 1.0
        stats = ex.refit()
        kinds.append(ex.last_delta.keyframe)
        want = dense.refit()
        assert stats.digest == want.digest  # the resulting weights' digest; this plan shifts no value
    assert kinds == [True, False, False, True, False, False, True]
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ArgumentError, match="keyframe_every"):
            DeltaPolicy(keyframe_every=bad)
    with pytest.raises(ArgumentError, match="DeltaPolicy"):
        make_executor("inprocess", plan, None, 0, source, got, delta=3)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3000), st.floats(0.0, 1.0), st.integers(0, 2**16))
def test_bitmaps_round_trip(n, p, seed):
    """pack_bits / unpack_bits against an independent construction: bit j of byte k is element 8k + j."""
    from reshard.executors.delta import pack_bits, unpack_bits

    g = torch.Generator().manual_seed(seed)
    idx = torch.nonzero(torch.rand(n, generator=g) < p).view(-1)
    packed = pack_bits(idx, n)
    bits = torch.zeros(len(packed) * 8, dtype=torch.int64)
    bits[idx] = 1
    assert torch.equal(packed, (bits.view(-1, 8) << torch.arange(8)).sum(1).to(torch.uint8))
    assert torch.equal(unpack_bits(packed), idx)
