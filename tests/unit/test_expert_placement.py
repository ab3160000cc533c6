"""EPLB expert placements (reshard.layouts.expert_placement) and the vLLM layouts that carry them: vLLM's initial
placement written out by hand, bad maps refused naming what is wrong, the placement part of a layout's identity
(equality, JSON, string, plan digest), the planner's slot proof refusing layouts that lie about their slots, and
the engine side refusing a plan of another placement (no vLLM here: the tests in tests/integration/vllm read the
placement from vLLM's own EPLB state)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import reshard
from reshard.adapters.refit import RefitSpec
from reshard.adapters.vllm.experts import check_loader_placement, check_placement
from reshard.errors import ArgumentError, CoverageError, LayoutError, LayoutMismatchError
from reshard.layouts import ExpertPlacement, VllmLayout, layout_from_dict, layout_to_dict, parse_layout
from reshard.layouts.base import PlacementTable
from harness.layouts import placement_row, replica_counts, slots_of

MOE = reshard.ModelSpec(family="qwen3_moe", hidden_size=8, num_layers=3, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=4, intermediate_size=8, vocab_size=64, num_experts=4, moe_intermediate_size=4,
                        dense_layers=(1,), dtype="float32")  # MoE layers 0 and 2: EPLB numbers them 0 and 1
SRC = reshard.MegatronLayout(model=MOE, tp=2, ep=2, etp=1, world=2)
# two MoE layers, 4 experts in 6 slots over 2 EP ranks: expert 1 twice in layer 0, experts 3 twice in layer 1
MOVED = ExpertPlacement(ranks=2, logical_experts=4, physical_to_logical=((1, 0, 1, 3, 2, 0), (3, 2, 1, 3, 0, 3)))
TWO_EXPERTS = ExpertPlacement(ranks=2, logical_experts=2, physical_to_logical=((0, 1, 0, 1, 1, 0),))
W13 = "model.layers.0.mlp.experts.routed_experts.w13_weight"


def test_initial_placement_is_vllms():
    """EplbState.build_initial_global_physical_to_logical_map: experts in order, then redundant slot i holds
    expert i mod E (written out here by hand)."""
    p = ExpertPlacement.initial(4, 6, 5)
    assert p.physical_to_logical == ((0, 1, 2, 3, 0, 1, 2, 3, 0, 1),)
    assert (p.num_physical, p.slots_per_rank, p.redundant, p.is_initial) == (10, 2, 6, True)
    assert slots_of(p, 0, 1) == (1, 5, 9) and replica_counts(p).tolist() == [[3, 3, 2, 2]]
    assert not MOVED.is_initial and placement_row(MOVED, 1) == (3, 2, 1, 3, 0, 3)


def test_uniform_rows_are_one_row():
    """One placement, one value: the same row for every layer is stored once (equal values, one digest)."""
    row = (0, 1, 2, 3, 1, 0)
    every = ExpertPlacement(ranks=2, logical_experts=4, physical_to_logical=(row, row, row))
    one = ExpertPlacement(ranks=2, logical_experts=4, physical_to_logical=(row,))
    assert every == one and every.digest == one.digest and every.num_rows == 1
    assert ExpertPlacement.model_validate_json(one.model_dump_json()) == one


def _maps(p2l: np.ndarray, E: int) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's logical -> physical (ascending slots, -1 padded to 1024 as EplbState does) and replica counts."""
    l2p = np.full((len(p2l), E, 1024), -1)
    counts = np.zeros((len(p2l), E), dtype=np.int64)
    for m, row in enumerate(p2l):
        for slot, e in enumerate(row):
            l2p[m, e, counts[m, e]] = slot
            counts[m, e] += 1
    return l2p, counts


def test_from_vllm_reads_all_three_maps():
    p2l = np.asarray(MOVED.physical_to_logical)
    l2p, counts = _maps(p2l, 4)
    got = ExpertPlacement.from_vllm(p2l, ranks=2, logical_experts=4, logical_to_physical=l2p,
                                    logical_replica_count=counts)
    assert got == MOVED


@pytest.mark.parametrize("case,field,words", [
    ("out of range", "physical_to_logical", ["layer 1 slot 2 holds expert 4", "permutation with replicas"]),
    ("missing expert", "physical_to_logical", ["layer 1 places no replica of experts [1]"]),
    ("ragged", "physical_to_logical", ["same number of physical slots"]),
    ("uneven ranks", "physical_to_logical", ["split evenly over ranks=4"]),
    ("too few slots", "physical_to_logical", ["each of the 4 logical experts"]),
    ("count", "logical_replica_count", ["layer 0 expert 1: 1 replicas", "puts it in 2 slots [0, 2]"]),
    ("slot list", "logical_to_physical", ["layer 1 expert 3: lists slots [0, 3, 5]", "puts it in [0, 3]"]),
    ("padding", "logical_to_physical", ["layer 0 expert 2", "then -1 padding"]),
    ("float map", "physical_to_logical", ["integer array"]),
])
def test_bad_maps_refused_naming_them(case, field, words):
    p2l = np.asarray(MOVED.physical_to_logical)
    l2p, counts = _maps(p2l, 4)
    kw: dict = {"ranks": 2, "logical_experts": 4}
    if case == "out of range":
        p2l[1, 2] = 4
    elif case == "missing expert":
        p2l[1, 2] = 0
    elif case == "ragged":
        p2l = [p2l[0].tolist(), p2l[1][:4].tolist()]
        kw["ranks"] = 1
        with pytest.raises(ArgumentError) as e:
            ExpertPlacement(physical_to_logical=p2l, **kw)
        assert e.value.field == field and all(w in str(e.value) for w in words), str(e.value)
        return
    elif case == "uneven ranks":
        kw["ranks"] = 4
    elif case == "too few slots":
        p2l = p2l[:, :3]
        kw["ranks"] = 1
    elif case == "count":
        counts[0, 1] = 1
        kw["logical_replica_count"] = counts
    elif case == "slot list":
        l2p[1, 3, 2] = 5  # layer 1: expert 3 sits in slots 0, 3 and 5 -- slot 5 claimed again
        p2l[1, 5] = 0
        l2p[1, 0, 1] = -1
        l2p, counts = l2p, _maps(p2l, 4)[1]
        kw.update(logical_to_physical=l2p, logical_replica_count=counts)
    elif case == "padding":
        l2p[0, 2, 0], l2p[0, 2, 1] = -1, 4  # a -1 before a slot: vLLM's lists are slots first, then padding
        kw["logical_to_physical"] = l2p
    elif case == "float map":
        p2l = p2l.astype(float)
    with pytest.raises(ArgumentError) as e:
        ExpertPlacement.from_vllm(p2l, **kw)
    assert e.value.field == field and all(w in str(e.value) for w in words), str(e.value)


def test_placement_is_part_of_the_layouts_identity():
    """Equality, hashing, JSON and the layout string all carry the placement; the initial one given explicitly is
    the same layout as redundant_experts alone; layouts without EPLB keep the JSON form they had."""
    plain = VllmLayout(model=MOE, tp=2, expert_parallel=True)
    assert set(layout_to_dict(plain)) == {"engine", "model", "tp", "replicas", "expert_parallel", "vocab_padding"}
    initial = VllmLayout(model=MOE, tp=2, expert_parallel=True, redundant_experts=2)
    explicit = VllmLayout(model=MOE, tp=2, expert_parallel=True, expert_placement=ExpertPlacement.initial(4, 2, 2))
    assert initial == explicit and hash(initial) == hash(explicit) and explicit.expert_placement is None
    assert str(initial) == "vllm:tp=2,replicas=1,ep,redundant_experts=2"
    assert parse_layout(str(initial), MOE) == initial
    moved = VllmLayout(model=MOE, tp=2, expert_parallel=True, expert_placement=MOVED)
    assert moved.redundant_experts == 2 and moved != initial and moved.experts == MOVED
    assert str(moved) == f"vllm:tp=2,replicas=1,ep,redundant_experts=2,placement={MOVED.digest[:12]}"
    assert layout_from_dict(layout_to_dict(moved)) == moved
    with pytest.raises(LayoutError, match="carried by the layout's JSON form"):
        parse_layout(str(moved), MOE)
    a, b = reshard.compile(SRC, initial), reshard.compile(SRC, moved)
    assert a.digest != b.digest and reshard.Plan.from_dict(b.to_dict()).dst == moved


@pytest.mark.parametrize("fields,words", [
    ({"expert_placement": MOVED.model_copy(update={"ranks": 1})}, ["EP ranks: the placement's 1, the layout's 2"]),
    ({"expert_placement": TWO_EXPERTS}, ["logical experts: the placement's 2, the layout's 4"]),
    ({"expert_placement": MOVED, "redundant_experts": 4}, ["redundant experts: the placement's 2, the layout's 4"]),
    ({"expert_placement": MOVED.model_copy(update={"physical_to_logical": MOVED.physical_to_logical * 2})},
     ["the placement has 4 rows, the model 2 MoE layers"]),
    ({"redundant_experts": 1}, ["num_experts + redundant_experts=5 is not divisible by tp"]),
    ({"redundant_experts": 2, "expert_parallel": False}, ["need expert_parallel=True"]),
])
def test_placement_of_another_engine_refused(fields, words):
    with pytest.raises(LayoutError) as e:
        VllmLayout(model=MOE, tp=2, **{"expert_parallel": True, **fields})
    assert all(w in str(e.value) for w in words), str(e.value)


class _SlotsSwapped(VllmLayout):
    """Declares two slots of rank 0's first MoE layer holding each other's experts: the placements table and the
    placement disagree (the table is right, the placement it reports is not)."""

    def expert_stacks(self, replica: int = 0):
        stacks = super().expert_stacks(replica)
        logical = stacks.logical.copy()
        logical[0, [0, 1]] = logical[0, [1, 0]]  # rank 0's first stacked tensor: its first two slots
        return stacks._replace(logical=logical)


class _ReplicaDropped(VllmLayout):
    """Leaves one redundant slot out of its placements table: that slot would be padding, never written."""

    def placement_table(self, index=None, replica=None):
        t = super().placement_table(index, replica)
        w13 = [k for k, (name, _) in enumerate(t.kinds) if name == W13]
        slot_numel = int(np.prod(t.kinds[w13[0]][1][1:]))
        drop = np.isin(t.kind, w13) & (t.rank == 1) & (t.origin // slot_numel == 2)
        return PlacementTable(*(getattr(t, c)[~drop] for c in PlacementTable.COLUMNS), kinds=t.kinds)


class _ReplicaShifted(VllmLayout):
    """Puts gate and up the other way round in one replica slot only: every slot fully written from its own
    expert, but the replicas of expert 1 then hold different bytes."""

    def placement_table(self, index=None, replica=None):
        t = super().placement_table(index, replica)
        w13 = [k for k, (name, _) in enumerate(t.kinds) if name == W13]
        shape = t.kinds[w13[0]][1]
        slot_numel, half = int(np.prod(shape[1:])), int(np.prod(shape[1:])) // 2
        mine = np.isin(t.kind, w13) & (t.rank == 0) & (t.origin // slot_numel == 2)
        origin = t.origin.copy()
        first = (origin % slot_numel) < half
        origin[mine & first] += half
        origin[mine & ~first] -= half
        cols = {c: getattr(t, c) for c in PlacementTable.COLUMNS}
        cols["origin"] = origin
        return PlacementTable(**cols, kinds=t.kinds)


@pytest.mark.parametrize("cls,words", [
    (_SlotsSwapped, ["receives bytes of another expert", "slot 0 (logical expert 0)"]),
    (_ReplicaDropped, ["not (like its replicas) model data", "slot 2 (logical expert 0)", "places 0 of its 64"]),
    (_ReplicaShifted, ["replicas of one expert receive different bytes", "slot 2 (logical expert 1)"]),
])
def test_slot_proof_refuses_layouts_that_lie_about_slots(cls, words):
    """The slot proof reads the placement itself (expert_stacks), not the placements table the ops come from: a
    table that leaves a replica out, feeds a slot another expert, or arranges one replica otherwise is refused."""
    with pytest.raises(CoverageError) as e:
        reshard.compile(SRC, cls(model=MOE, tp=2, expert_parallel=True, expert_placement=MOVED))
    assert all(any(w in p for p in e.value.problems) or w in str(e.value) for w in words), str(e.value)


def test_engine_refuses_a_plan_of_another_placement():
    """The failure users hit: a refit planned by the initial placement into an engine EPLB rebalanced. Refused
    naming both placements by digest; a plan of the engine's own placement passes."""
    initial = VllmLayout(model=MOE, tp=2, expert_parallel=True, redundant_experts=2)
    moved = initial.model_copy(update={"expert_placement": MOVED})
    with pytest.raises(LayoutMismatchError) as e:
        check_placement(initial, MOVED, "engine replica 0")
    text = str(e.value)
    assert initial.experts.digest[:12] in text and MOVED.digest[:12] in text and "recompile" in text, text
    check_placement(moved, MOVED)
    check_placement(initial, ExpertPlacement.initial(4, 2, 2))
    with pytest.raises(LayoutMismatchError, match="EPLB state holds"):  # an engine without EPLB: linear order
        check_placement(initial, None)
    check_placement(VllmLayout(model=MOE, tp=2, expert_parallel=True), None)
    with pytest.raises(LayoutMismatchError, match="load_weights writes experts by the initial placement"):
        check_loader_placement(MOVED)
    check_loader_placement(ExpertPlacement.initial(4, 2, 2))


def test_refit_spec_follows_the_engines_placement():
    """The trainer side: a spec for the engine's current placement (digest cleared, plan for the new layout)."""
    initial = VllmLayout(model=MOE, tp=2, expert_parallel=True, redundant_experts=2)
    spec = RefitSpec.of(MOE, SRC, initial, transport="inprocess")
    spec = replace(spec, plan_digest=spec.plan().digest)
    moved = spec.with_expert_placement(MOVED)
    assert moved.plan_digest == "" and moved.layouts()[1].experts == MOVED
    assert moved.plan().digest != spec.plan().digest
    assert RefitSpec.from_dict(moved.to_dict()) == moved
    assert moved.with_expert_placement(None).layouts()[1] == initial
    with pytest.raises(ArgumentError, match="an ExpertPlacement"):
        spec.with_expert_placement(MOVED.physical_to_logical)
