"""EPLB redundant experts fed by the engine (planner.fanout.slot_copies), over random placements and replica counts:
with fan-out (a transport that relays) the trainer sends each destination engine one copy of each logical expert,
however many slots hold it (without, it feeds every slot, as the in-process transports need); every slot,
each replica included, still receives exactly its logical expert's bytes (checked against the HF weights, vLLM's
w13 = [gate; up], w2 = down); the accounting says what the copies move (and which stay on their rank) and equals
the accounting of the expanded ops; a saved plan loads back, and a copy that reads another expert is refused."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import reshard
from reshard.errors import PlanFileError
from reshard.executors import allocate, execute_local, shard
from reshard.layouts import VllmLayout
from reshard.planner import Plan
from harness.accounting import account
from reshard.planner.plan import SOURCE
from reshard.testing.strategies import expert_placements, megatron_layouts, models, vllm_tp_choices
from harness.layouts import placement_row


@st.composite
def redundant_refits(draw):
    """A MoE model, a Megatron source and an EP vLLM destination with at least one redundant expert, 1-3 engines,
    a random placement (or vLLM's initial one), with or without fan-out across the engines."""
    model = draw(models(moe=True))
    tp = draw(st.sampled_from(vllm_tp_choices(model, True) or [1]))
    redundant = tp * draw(st.integers(1, 3))
    placement = draw(st.none() | expert_placements(model, tp, redundant))
    dst = VllmLayout(model=model, tp=tp, expert_parallel=True, replicas=draw(st.integers(1, 3)),
                     redundant_experts=redundant, expert_placement=placement)
    return draw(megatron_layouts(model)), dst, draw(st.sampled_from([None, 1, 2]))


def _expert_bytes(plan: Plan, ops: dict[str, np.ndarray]) -> np.ndarray:
    """Per destination engine, the routed experts' bytes the trainer sends it."""
    expert = plan.src.model.canonical.expert[ops["canon"]] >= 0
    mine = (ops["src_side"] == SOURCE) & expert
    engine = ops["dst_rank"][mine] // plan.dst.ranks_per_replica
    return np.bincount(engine, weights=(ops["rows"] * ops["cols"])[mine] * plan.itemsize,
                       minlength=plan.dst.num_replicas).astype(np.int64)


@settings(max_examples=40, deadline=None)
@given(redundant_refits(), st.integers(0, 2**16))
def test_trainer_sends_each_engine_one_copy_and_every_slot_lands(refit, seed):
    src, dst, fanout = refit
    model, p = src.model, dst.experts
    plan = reshard.compile(src, dst, fanout=fanout)
    every_slot = reshard.compile(src, dst, fanout=fanout, expert_copies=False)
    experts = sum(t.numel for t in model.tensors if model.canonical.expert[t.index] >= 0) * plan.itemsize
    fed = plan.program.parent[0] < 0
    sent = _expert_bytes(plan, plan.ops)
    if fanout:  # the engine's ranks relay: one copy of each expert per engine
        assert sent.tolist() == [experts if f else 0 for f in fed], (sent, experts)
    else:  # no relays (the in-process transports run none): the trainer feeds every slot, as before
        assert not plan.program.num_copy_ops and plan.digest == every_slot.digest
        return
    assert (_expert_bytes(every_slot, every_slot.ops)[fed] > experts).all()  # the second sends it copies away
    slot = experts // model.num_experts  # one expert's bytes over the MoE layers, when every row is alike
    a = plan.accounting
    assert a.slot_copy_bytes == dst.num_replicas * p.redundant * slot or p.num_rows > 1
    # what the engines copy is what the trainer no longer sends (relayed engines copied from their parent before)
    saved = sum(every_slot.accounting.egress_bytes) - sum(a.egress_bytes)
    assert saved * dst.num_replicas == a.slot_copy_bytes * int(fed.sum())
    assert a.total_bytes == every_slot.accounting.total_bytes
    assert account(plan.ops, plan.itemsize, src.num_ranks, dst.num_ranks, plan.colocation, plan.bounds,
                   dst.ranks_per_replica) == a

    g = torch.Generator().manual_seed(seed)
    weights = {t.name: torch.randn(t.shape, generator=g) for t in model.tensors}
    got = allocate(dst, fill=float("nan"))
    execute_local(plan, shard(src, weights), got)
    S, moe = p.slots_per_rank, [i for i in range(model.num_layers) if model.is_moe_layer(i)]
    for rank in range(dst.num_ranks):
        for m, layer in enumerate(moe):
            w13 = got[rank][f"model.layers.{layer}.mlp.experts.routed_experts.w13_weight"]
            w2 = got[rank][f"model.layers.{layer}.mlp.experts.routed_experts.w2_weight"]
            for s in range(S):
                e = placement_row(p, m)[(rank % dst.tp) * S + s]
                hf = f"model.layers.{layer}.mlp.experts.{e}"
                want = torch.cat([weights[f"{hf}.gate_proj.weight"], weights[f"{hf}.up_proj.weight"]])
                assert torch.equal(w13[s], want), (dst, rank, layer, s, e)
                assert torch.equal(w2[s], weights[f"{hf}.down_proj.weight"]), (dst, rank, layer, s, e)


@settings(max_examples=15, deadline=None)
@given(redundant_refits())
def test_slot_copies_survive_saving_and_a_wrong_one_is_refused(refit):
    src, dst, fanout = refit
    plan = reshard.compile(src, dst, fanout=fanout or 1)
    assert plan.program.num_copy_ops
    again = Plan.from_dict(plan.to_dict())
    assert again.digest == plan.digest and again.accounting == plan.accounting
    c = dict(plan.program.copies)
    wrong = np.roll(np.arange(len(c["rows"])), 1)  # each copy reads the next one's source: a real slot, another
    for k in ("src_rank", "src_tensor", "src_offset", "src_stride"):  # expert's (or the same expert's, if equal)
        c[k] = c[k][wrong]
    if all(np.array_equal(c[k], plan.program.copies[k]) for k in c):
        return
    tampered = dataclasses.replace(plan, program=dataclasses.replace(plan.program, copies=c), digest="")
    with pytest.raises(PlanFileError, match="slot cop"):  # the digest matches the content: the proof refuses it
        Plan.from_dict(tampered.to_dict())
