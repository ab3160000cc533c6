"""Refits into EPLB engines over random placements and replica counts: every physical slot -- each replica of a
logical expert included -- receives exactly the weights of the logical expert the placement names, checked
against the HF weights directly (vLLM's w13 = [gate; up], w2 = down), not against the layout; vLLM's three maps
read back into the same placement; the batched placements table equals the per-tensor reference."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings, strategies as st

import reshard
from reshard.errors import ArgumentError
from reshard.executors import allocate, execute_local, shard
from reshard.layouts import ExpertPlacement, Layout, VllmLayout
from reshard.testing.strategies import expert_placements, megatron_layouts, models, vllm_tp_choices
from harness.layouts import placement_row, replica_counts, table_rows

SENTINEL = float("nan")


@st.composite
def eplb_refits(draw):
    """A random MoE model, a Megatron source, and an expert-parallel vLLM destination with redundant experts (a
    multiple of the EP size, as EPLB needs) and a random placement (or vLLM's initial one)."""
    model = draw(models(moe=True))
    tp = draw(st.sampled_from(vllm_tp_choices(model, True) or [1]))
    redundant = tp * draw(st.integers(0, 3))
    placement = draw(st.none() | expert_placements(model, tp, redundant))
    dst = VllmLayout(model=model, tp=tp, expert_parallel=True, replicas=draw(st.integers(1, 2)),
                     redundant_experts=redundant, expert_placement=placement)
    return draw(megatron_layouts(model)), dst


@settings(max_examples=40)
@given(eplb_refits(), st.integers(0, 2**16), st.sampled_from([None, 1]))
def test_every_slot_holds_its_logical_expert(pair, seed, fanout):
    src, dst = pair
    model, p = src.model, dst.experts
    plan = reshard.compile(src, dst, fanout=fanout)
    g = torch.Generator().manual_seed(seed)
    weights = {t.name: torch.randn(t.shape, generator=g) for t in model.tensors}
    got = allocate(dst, fill=SENTINEL)
    execute_local(plan, shard(src, weights), got)
    S, moe = p.slots_per_rank, [i for i in range(model.num_layers) if model.is_moe_layer(i)]
    for rank in range(dst.num_ranks):
        ep_rank = rank % dst.tp
        for m, layer in enumerate(moe):
            w13 = got[rank][f"model.layers.{layer}.mlp.experts.routed_experts.w13_weight"]
            w2 = got[rank][f"model.layers.{layer}.mlp.experts.routed_experts.w2_weight"]
            assert w13.shape[0] == S == w2.shape[0]
            for slot in range(S):
                e = placement_row(p, m)[ep_rank * S + slot]
                hf = f"model.layers.{layer}.mlp.experts.{e}"
                want = torch.cat([weights[f"{hf}.gate_proj.weight"], weights[f"{hf}.up_proj.weight"]])
                assert torch.equal(w13[slot], want), (dst, rank, layer, slot, e)
                assert torch.equal(w2[slot], weights[f"{hf}.down_proj.weight"]), (dst, rank, layer, slot, e)


@settings(max_examples=60)
@given(st.integers(1, 12), st.integers(1, 4), st.integers(0, 3), st.integers(1, 3), st.data())
def test_vllm_maps_read_back(E, ranks, per_rank, layers, data):
    """physical -> logical, logical -> physical (ascending, -1 padded) and the counts, as vLLM's
    compute_logical_maps makes them, read back into the placement; any one entry changed is refused."""
    P = ranks * max(per_rank, -(-E // ranks))
    rows = []
    for _ in range(layers):
        slots = list(range(E)) + data.draw(st.lists(st.integers(0, E - 1), min_size=P - E, max_size=P - E))
        rows.append(data.draw(st.permutations(slots)))
    p2l = np.asarray(rows, dtype=np.int64)
    K = int(max(np.bincount(r, minlength=E).max() for r in p2l)) + data.draw(st.integers(0, 2))
    l2p, counts = np.full((layers, E, K), -1), np.zeros((layers, E), dtype=np.int64)
    for m in range(layers):
        for slot in range(P):
            e = p2l[m, slot]
            l2p[m, e, counts[m, e]] = slot
            counts[m, e] += 1
    p = ExpertPlacement.from_vllm(p2l, ranks=ranks, logical_experts=E, logical_to_physical=l2p,
                                  logical_replica_count=counts)
    assert np.array_equal(p.table(), p2l if len(set(map(tuple, rows))) > 1 else p2l[:1])
    assert np.array_equal(replica_counts(p), counts if p.num_rows > 1 else counts[:1])
    which = data.draw(st.sampled_from(["count", "slot list"]))
    m, e = data.draw(st.integers(0, layers - 1)), data.draw(st.integers(0, E - 1))
    if which == "count":
        counts[m, e] += data.draw(st.sampled_from([-1, 1]))
        kwargs = {"logical_replica_count": counts}
    else:
        j = data.draw(st.integers(0, K - 1))
        l2p[m, e, j] = (l2p[m, e, j] + 1) % P if l2p[m, e, j] >= 0 else (0 if j + 1 < K else P)
        kwargs = {"logical_to_physical": l2p}
    try:
        ExpertPlacement.from_vllm(p2l, ranks=ranks, logical_experts=E, **kwargs)
    except ArgumentError as err:
        assert err.field in kwargs and f"layer {m} expert" in str(err), str(err)
    else:  # a changed entry that still lists the same slots: only a -1 past the end turned into another -1
        assert which == "slot list" and sorted(l2p[m, e][l2p[m, e] >= 0]) == sorted(np.flatnonzero(p2l[m] == e))


@settings(max_examples=40)
@given(eplb_refits())
def test_batched_table_is_the_reference(pair):
    _, dst = pair
    for replica in (None, 0):
        assert sorted(table_rows(dst.placement_table(replica=replica))) == \
            sorted(table_rows(Layout.placement_table(dst, replica=replica)))
