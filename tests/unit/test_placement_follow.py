"""The trainers follow an EPLB engine's placement (reshard.adapters.placement_follow), without vLLM: an engine's
report reaches trainer process 0 through the refit's store (a real TCPStore) or, in process, through the process;
process 0 decides and the other trainer processes read its word before they send ("go", "fail", or the placement
to follow); engines reporting different placements are refused; `follow` recompiles only the destination, runs the
step again and notes both digests, and gives up after MOST_FOLLOWS. (tests/integration/vllm/test_vllm_eplb.py runs
it against vLLM's own EPLB code.)"""
from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

import reshard
from reshard.adapters import rendezvous as rv
from reshard.adapters.placement_follow import MOST_FOLLOWS, agree, follow, report
from reshard.adapters.refit import RefitSpec
from reshard.errors import ExecutionError
from reshard.layouts import ExpertPlacement, VllmLayout

MOE = reshard.ModelSpec(family="qwen3_moe", hidden_size=8, num_layers=3, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=4, intermediate_size=8, vocab_size=64, num_experts=4, moe_intermediate_size=4,
                        dense_layers=(1,), dtype="float32")
SRC = reshard.MegatronLayout(model=MOE, tp=2, ep=2, etp=1, world=2)
MOVED = ExpertPlacement(ranks=2, logical_experts=4, physical_to_logical=((1, 0, 1, 3, 2, 0), (3, 2, 1, 3, 0, 3)))
OTHER = ExpertPlacement(ranks=2, logical_experts=4, physical_to_logical=((1, 0, 2, 3, 0, 1),))
INITIAL = VllmLayout(model=MOE, tp=2, expert_parallel=True, redundant_experts=2)


def session(refit: RefitSpec, process: int = 0, store=None) -> SimpleNamespace:
    return SimpleNamespace(refit_spec=refit, process=process, store=store, timeout=5.0, to_follow=None, followed=[])


@pytest.fixture
def shared():
    """A cross-process refit's spec, the store trainer process 0 hosts, and a second trainer process's client."""
    rdv, store = rv.host_store(rv.Rendezvous.new("127.0.0.1", timeout=10.0))
    spec = RefitSpec.of(MOE, SRC, INITIAL.model_copy(update={"replicas": 2}), transport="collective")
    return replace(spec, rendezvous=rdv.to_dict()), store, rv.connect(rdv)


def test_in_process_report_is_followed():
    refit = RefitSpec.of(MOE, SRC, INITIAL, transport="inprocess", options={"key": "follow-test"})
    report(replace(refit, replica=0), None, MOVED)  # what a refusing worker in this process tells its trainer
    s = session(refit)
    errors = agree(s, "1", ["engine replica 0: LayoutMismatchError ..."], time.monotonic() + 5)
    assert s.to_follow == MOVED and MOVED.digest[:12] in errors[-1]
    assert agree(s, "2", [], time.monotonic() + 5) == [] and s.to_follow is None  # nothing reported: go on
    s = session(replace(refit, install="loader"))  # a loader install writes the initial placement: never followed
    report(replace(refit, replica=0), None, MOVED)
    assert agree(s, "3", ["refused"], time.monotonic() + 5) == ["refused"] and s.to_follow is None


def test_process_zero_decides_and_the_others_wait_for_its_word(shared):
    refit, store, client = shared
    zero, one = session(refit, 0, store), session(refit, 1, client)
    assert agree(zero, "1", [], time.monotonic() + 5) == []  # the engines started: "go"
    assert agree(one, "1", [], time.monotonic() + 5) == []
    assert agree(zero, "2", ["engine replica 1: the lease lapsed"], time.monotonic() + 5)  # refused otherwise
    said = agree(one, "2", [], time.monotonic() + 5)
    assert one.to_follow is None and "trainer process 0 reported that the engines refused" in said[0]
    for k in (0, 1):  # both engines rebalanced alike, and told the store, refusing
        report(replace(refit, replica=k), None, MOVED)
    agree(zero, "3", ["engine replica 0: LayoutMismatchError"], time.monotonic() + 5)
    said = agree(one, "3", [], time.monotonic() + 5)
    assert zero.to_follow == one.to_follow == MOVED and "recompiling" in said[-1]
    late = session(refit, 1, client)  # no word for step 4 from process 0: bounded by the deadline
    assert "no word from trainer process 0" in agree(late, "4", [], time.monotonic() + 0.2)[-1]


def test_engines_of_one_refit_holding_different_placements_are_refused(shared):
    refit, store, client = shared
    report(replace(refit, replica=0), None, MOVED)
    report(replace(refit, replica=1), store, OTHER)
    zero, one = session(refit, 0, store), session(refit, 1, client)
    said = agree(zero, "1", ["refused"], time.monotonic() + 5)
    assert zero.to_follow is None and "different expert placements" in said[-1] and MOVED.digest[:12] in said[-1]
    assert agree(one, "1", [], time.monotonic() + 5)[-1].endswith("refused the refit")


def test_follow_recompiles_only_the_destination_and_notes_both_digests():
    refit = RefitSpec.of(MOE, SRC, INITIAL, transport="inprocess", options={"key": "follow-test-2"})
    s = session(refit)
    inits, calls = [], []
    s.init = lambda: inits.append(s.refit_spec)

    def step():
        calls.append(s.refit_spec.layouts()[1].experts)
        if len(calls) == 1:  # the engines refused: agree set what to follow
            s.to_follow = MOVED
            raise ExecutionError("refit '1' failed")
        return "done"

    assert follow(s, step, "refit 1") == "done"
    src, dst = s.refit_spec.layouts()
    assert src == SRC and dst.experts == MOVED and calls == [INITIAL.experts, MOVED] and len(inits) == 1
    note = s.followed[-1]
    assert (note["step"], note["from"], note["to"]) == ("refit 1", INITIAL.experts.digest, MOVED.digest)

    def moving():  # EPLB moves on every try: the follow gives up, raising the step's error
        s.to_follow = MOVED if s.refit_spec.layouts()[1].experts != MOVED else OTHER
        raise ExecutionError("refused again")

    with pytest.raises(ExecutionError, match="refused again"):
        follow(s, moving, "refit 2")
    assert len(s.followed) == 1 + MOST_FOLLOWS
    with pytest.raises(ExecutionError, match="not a placement matter"):  # nothing to follow: raised as it was
        follow(s, lambda: (_ for _ in ()).throw(ExecutionError("not a placement matter")), "refit 3")
