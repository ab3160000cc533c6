"""The distributed executor across real processes (gloo on CPU): random plans byte-identical to the local
executor; colocated, disjoint and subgroup bindings; fan-out egress; a peer killed or hanging mid-refit.

Process start-up dominates here (seconds per process on a small machine), so each test starts one world and
runs many refits inside it."""
from __future__ import annotations

from pathlib import Path

import pytest

import reshard
from reshard.executors.binding import Binding
from harness.refit_cases import (as_jobs, examples, failures, random_cases, survivor_failures,
                                         tiny_deepseek, tiny_spec)
from harness.refit_jobs import SENTINEL  # noqa: F401 - documents what "unchanged" means
from reshard.testing.world import run_world

pytestmark = pytest.mark.gloo
WORLD = 4
RANDOM_CASES = 28


def _fixed_cases():
    """Named shapes every run covers (name, plan, binding, group members, options)."""
    spec = tiny_spec()
    M, V = reshard.MegatronLayout, reshard.VllmLayout
    small = {"bucket_bytes": 512, "timeout": 60.0, "direct_bytes": 128}
    return [
        ("disjoint tp2 -> tp2", reshard.compile(M(model=spec, tp=2), V(model=spec, tp=2)),
         Binding.disjoint(2, 2), None, small),
        ("a process refuses its tensors: all raise, nothing moves", reshard.compile(M(model=spec, tp=2),
                                                                                    V(model=spec, tp=2)),
         Binding.disjoint(2, 2), None, {**small, "refuse": 3}),
        ("colocated tp2pp2 -> tp2 x2", reshard.compile(M(model=spec, tp=2, pp=2), V(model=spec, tp=2, replicas=2),
                                                       colocated=True),
         Binding.colocated(4, 4), None, small),
        ("colocated in place", reshard.compile(M(model=spec, tp=2, pp=2), V(model=spec, tp=2, replicas=2),
                                               colocated=True),
         Binding.colocated(4, 4), None, {**small, "in_place": True}),
        ("colocated undo", reshard.compile(M(model=spec, tp=2, pp=2), V(model=spec, tp=2, replicas=2),
                                           colocated=True),
         Binding.colocated(4, 4), None, {**small, "undo": True}),
        ("subgroup, fan-out relay", reshard.compile(M(model=spec), V(model=spec, replicas=2), fanout=1),
         Binding.disjoint(1, 2), [1, 2, 3], small),
        ("world, three lanes", reshard.compile(M(model=spec, tp=2), V(model=spec, tp=2)),
         Binding.colocated(2, 2), None, {**small, "lanes": 3}),
        ("subgroup, two lanes", reshard.compile(M(model=spec, tp=2), V(model=spec, replicas=2)),
         Binding((0, 1), (1, 0)), [0, 2], {**small, "lanes": 2}),
        ("DeepSeek: float32 router bias in a bfloat16 model", reshard.compile(M(model=tiny_deepseek(), tp=2, ep=2),
                                                                          V(model=tiny_deepseek(), tp=2)),
         Binding.colocated(4, 2), None, {**small, "undo": True}),
        ("fan-out x3 from one trainer", reshard.compile(M(model=spec), V(model=spec, replicas=3), fanout=1),
         Binding.disjoint(1, 3), None, small),
        ("no fan-out x3 from one trainer", reshard.compile(M(model=spec), V(model=spec, replicas=3)),
         Binding.disjoint(1, 3), None, small),
        ("repeat with one executor", reshard.compile(M(model=spec, tp=2), V(model=spec, tp=1, replicas=2)),
         Binding((0, 1), (1, 3)), None, {**small, "repeat": 2}),
        ("group made over a store, two lanes, repeated", reshard.compile(M(model=spec, tp=2), V(model=spec, tp=2)),
         Binding.disjoint(2, 2), [0, 1, 2, 3], {**small, "lanes": 2, "store": True, "repeat": 2}),
    ]


def test_refits_across_processes_match_local_executor(tmp_path: Path):
    named = _fixed_cases()
    cases, labels = as_jobs(named, examples(random_cases(WORLD), RANDOM_CASES), tmp_path)
    results = run_world(WORLD, "harness.refit_jobs:run_cases", {"cases": cases}, tmp_path / "world",
                        timeout=600)
    logs = (tmp_path / "world" / "logs.txt").read_text()
    assert all(r is not None for r in results), f"a process died:\n{logs[-4000:]}"
    wrong = failures(results, cases, labels, WORLD)
    assert not wrong, "\n".join(wrong[:10])

    stats = lambda i, proc: results[proc][i]["stats"]  # noqa: E731
    named_index = {name: i for i, (name, *_) in enumerate(named)}
    # colocated: process d plays source d and destination d; its own bytes are local copies, never self-sends
    i = named_index["colocated tp2pp2 -> tp2 x2"]
    for proc in range(WORLD):
        assert str(proc) not in stats(i, proc)["bytes_sent"]
        assert stats(i, proc)["staged"]
    assert sum(stats(i, p)["local_bytes"] for p in range(WORLD)) > 0
    assert not stats(named_index["colocated in place"], 0)["staged"]
    assert stats(named_index["colocated undo"], 0)["undo"] and not stats(named_index["colocated undo"], 0)["staged"]
    # fan-out: the trainer sends one replica's worth whatever the replica count; without it, three
    fan, flat = named_index["fan-out x3 from one trainer"], named_index["no fan-out x3 from one trainer"]
    one_replica = named[fan][1].accounting.lower_bound_by_dst[0]
    assert sum(stats(fan, 0)["bytes_sent"].values()) == one_replica
    assert sum(stats(flat, 0)["bytes_sent"].values()) == 3 * one_replica
    relayed = sum(sum(stats(fan, p)["bytes_sent"].values()) for p in (1, 2, 3))
    assert relayed == 2 * one_replica
    # lanes: rounds spread over three communicators of the world (their own groups, made at the first refit)
    assert stats(named_index["world, three lanes"], 0)["lanes"] == 3
    assert stats(named_index["disjoint tp2 -> tp2"], 0)["lanes"] == 1  # gloo's default
    assert stats(named_index["group made over a store, two lanes, repeated"], 0)["lanes"] == 2
    # subgroup: world rank 0 sat out; group rank 0 (world rank 1) was the trainer
    sub = named_index["subgroup, fan-out relay"]
    assert results[0][sub] is None and sum(stats(sub, 1)["bytes_sent"].values()) == one_replica


@pytest.mark.parametrize("mode,undo,lanes,store", [("kill", False, 1, False), ("hang", False, 2, False),
                                                  ("kill", True, 2, False), ("kill", False, 1, True),
                                                  ("hang", False, 1, True)])
def test_dead_or_hanging_peer_fails_every_survivor(tmp_path: Path, mode: str, undo: bool, lanes: int, store: bool):
    """Group rank 0 (a trainer rank) dies or stops at round 2. Rank 2 receives from it and fails in its wait;
    rank 1 does not talk to it and fails in the verify step. Both raise ExecutionError within the timeout and
    keep their destination tensors unchanged: staged ones were never written, undo ones are put back."""
    spec = tiny_spec()
    plan = reshard.compile(reshard.MegatronLayout(model=spec, tp=2), reshard.VllmLayout(model=spec, tp=1))
    path = plan.save(tmp_path / "plan.npz")
    timeout = 2.0
    args = {"plan": str(path), "binding": Binding((0, 1), (2,)).to_dict(), "seed": 3, "victim": 0, "mode": mode,
            "at_round": 2, "hang_seconds": 2 * timeout + 1, "store": store,
            "options": {"timeout": timeout, "bucket_bytes": 256, "lanes": lanes, **({"undo": True} if undo else {})}}
    results = run_world(3, "harness.refit_jobs:fail_mid_refit", args, tmp_path / "world", timeout=120)
    logs = (tmp_path / "world" / "logs.txt").read_text()
    assert results[0] is None, "the victim should not have finished"
    wrong = survivor_failures(results, [1, 2], undo, timeout + 5.0, logs)
    assert not wrong, "\n".join(wrong)
    assert results[2]["has_dst"]  # rank 2 receives from the victim (its tensors were checked above)
