"""Trainer workers and vLLM engines as Ray actors (the NeMo-RL shape), on a local Ray cluster with bounded CPUs.

Trainer actors: megatron-core TP2 on gloo, in this virtualenv (no vLLM). Engine actors: vLLM CPU engines in the
vLLM virtualenv (`py_executable`): two TP1 replicas refit as one group with fan-out, one TP2 engine as a group of
its own, whose refits are staged (`RefitSpec(staging="device")`, `pause_for="flip"`: issue 40). Ground truth for
every step: the greedy tokens of vLLM loading the step's weights itself (harness.ray_jobs.ReferenceTokens: one
reference engine, which vLLM's own loader reloads from each step's file, as a fresh engine would load it), saved as
an HF checkpoint computed here from the first checkpoint by the same elementwise "training step" (independent of
Megatron and of reshard). The tests run in order on shared actors (starting engines costs most of the time):
  1. a GRPO-like loop of 3 steps: generate, train, refit every engine, generate; tokens equal the reference's,
     versions advance, trainer egress to the replicas is one copy of the model, both sides compile once; the
     train-inference mismatch (reshard.verify: megatron-core's scores against each engine actor's) flags the
     engines before the first refit and passes after the last;
  2. a flip that fails partway on the TP2 engine (its rank 1 raises inside the flip, $RESHARD_TEST_FLIP_FAULT;
     rank 0 installs: a mix): the actor refuses generation naming the torn version until a refit lands whole,
     then its tokens equal the reference's (issue 40, item 4);
  3. the TP2 engine killed mid-refit: its group's refit raises naming it, the replicas' group is unaffected; a new
     engine actor is initialized and refit without restarting the trainers (their plans reused);
  4. a replica that relays killed: its group's refit raises naming the fan-out tree;
  5. a trainer actor killed mid-refit: every engine's update fails and it keeps its previous weights and
     version; new trainer actors continue the loop.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from reshard.adapters.ray import RayEngineClient  # noqa: E402
from reshard.adapters.vllm.lease import TORN  # noqa: E402
from reshard.errors import ExecutionError  # noqa: E402
from reshard.testing.megatron_cpu import TinyGPT  # noqa: E402
from harness.ray_jobs import (ReferenceTokens, kill_engine, mismatch_all, open_group, refit_all,  # noqa: E402
                                      start_engine, start_trainers, stop_engine)
from harness.serve import vllm_cpu_python  # noqa: E402
from harness.serve_jobs import load_checkpoint, make_checkpoint, save_checkpoint, train_step  # noqa: E402

# Each Ray fault test restarts engine or trainer actors (minutes on 2 cores); in CI the same failures are covered
# for servers by tests/integration/serve/test_serve.py's fault tests and for Ray actors by test_ray_driver_death.py.
SLOW = pytest.mark.slow

pytestmark = [pytest.mark.ray, pytest.mark.crossprocess]

PROMPTS = [[1, 2, 3, 4, 5], [17, 40, 3, 99], [64, 65, 66, 7, 7, 7, 7, 80]]
STEPS = 3
TIMEOUT = 20.0  # the transport's timeout in the fault tests
REPLICAS = {"name": "replicas", "dst": {"tp": 1, "replicas": 2}, "fanout": 1, "timeout": 120,
            "options": {"timeout": TIMEOUT}}
# the TP2 engine stages its refits (issue 40): the bytes land while it may generate, the flip at install
TP2 = {"name": "tp2", "dst": {"tp": 2}, "fanout": 1, "timeout": 120, "options": {"timeout": TIMEOUT},
       "staging": "device", "pause_for": "flip"}


class Cluster:
    """The actors the tests share, and the checkpoints of every step."""

    def __init__(self, work: Path) -> None:
        self.ckpts = [make_checkpoint(TinyGPT(), work / "step-0")]
        for step in range(1, STEPS + 4):  # the loop, then one step for the torn flip and each fault test
            prev = load_checkpoint(self.ckpts[-1])
            self.ckpts.append(save_checkpoint({k: train_step(v, step) for k, v in prev.items()}, self.ckpts[0],
                                              work / f"step-{step}"))
        self.replicas = [start_engine(str(self.ckpts[0]), 1) for _ in range(2)]
        self.fault = work / "flip-fault"  # holds the rank whose flip raises, while it exists
        self.tp2 = start_engine(str(self.ckpts[0]), 2, env={"RESHARD_TEST_FLIP_FAULT": str(self.fault)})
        self.trainers = start_trainers(2, {"tp": 2, "checkpoint": str(self.ckpts[0])})
        self.step = 0
        self.references = ReferenceTokens(PROMPTS)

    def clients(self) -> dict[str, RayEngineClient]:
        out = {f"replica {k}": RayEngineClient(e, f"replica {k}") for k, e in enumerate(self.replicas)}
        out["tp2"] = RayEngineClient(self.tp2, "tp2")
        return out

    def reference(self, step: int) -> list:
        return self.references(str(self.ckpts[step]))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if vllm_cpu_python() is None:
        pytest.fail("no vLLM CPU virtualenv (scripts/bootstrap vllm makes .venv-vllm-cpu; scripts/test runs it)")
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    c = None
    try:
        c = Cluster(tmp_path_factory.mktemp("ray"))
        for client in c.clients().values():
            client.greedy(PROMPTS[:1])
        yield c
    finally:
        if c is not None:
            c.references.close()
            for e in [*c.replicas, c.tp2]:
                stop_engine(e)
        ray.shutdown()


def _ok(results: list[dict], group: str) -> bool:
    return all(r[group]["ok"] for r in results)


def test_grpo_loop_refits_every_engine_like_a_fresh_one(cluster):
    open_group(cluster.trainers, REPLICAS, cluster.replicas)
    opened = open_group(cluster.trainers, TP2, [cluster.tp2])
    engine_compiles = {n: [s["compiles"] for s in c.stats()] for n, c in cluster.clients().items()}
    trainer_compiles = [o["compiles"] for o in opened]
    model_bytes = sum(v.numel() * v.element_size() for v in load_checkpoint(cluster.ckpts[0]).values())
    for step in range(1, STEPS + 1):
        rollouts = {n: c.greedy(PROMPTS) for n, c in cluster.clients().items()}
        ray.get([t.train_step.remote(step) for t in cluster.trainers])
        if step == 1:  # the engines still hold step 0: the mismatch check must say so
            stale = mismatch_all(cluster.trainers, "tp2", PROMPTS)
            assert not stale["tp2[0]"]["ok"], stale
        results = refit_all(cluster.trainers, f"step-{step}")
        cluster.step = step
        assert _ok(results, "replicas") and _ok(results, "tp2"), results
        want = cluster.reference(step)
        for name, c in cluster.clients().items():
            assert c.greedy(PROMPTS) == want != rollouts[name], f"step {step}: {name} differs from the reference"
            assert c.weight_version() == f"step-{step}"
        # fan-out: the trainers send one copy of the model to the replicas' group, and to the TP2 engine
        assert sum(r["replicas"]["bytes_sent"] for r in results) == model_bytes
        assert sum(r["tp2"]["bytes_sent"] for r in results) == model_bytes
        # both sides compiled at init only
        assert [r["cache"]["compiles"] for r in results] == trainer_compiles
        assert {n: [s["compiles"] for s in c.stats()] for n, c in cluster.clients().items()} == engine_compiles
    reports = {**mismatch_all(cluster.trainers, "replicas", PROMPTS), **mismatch_all(cluster.trainers, "tp2", PROMPTS)}
    assert sorted(reports) == ["replicas[0]", "replicas[1]", "tp2[0]"], reports
    for name, report in reports.items():
        print(f"mismatch {name}: max {report['max_abs']:.3e} k3 {report['mean_k3']:.3e} "
              f"argmax {report['argmax_agreement']:.3f}")
        assert report["ok"], (name, report)


def test_a_flip_that_fails_partway_fences_the_engine_actor_until_a_refit_lands_whole(cluster):
    step, client = cluster.step + 1, RayEngineClient(cluster.tp2, "tp2")
    ray.get([t.train_step.remote(step) for t in cluster.trainers])
    cluster.fault.write_text("1")  # rank 1 raises inside its flip, rank 0 installs the new step: a mix
    try:
        results = refit_all(cluster.trainers, f"step-{step}-torn", ["tp2"])
    finally:
        cluster.fault.unlink()
    assert not _ok(results, "tp2") and TORN in results[0]["tp2"]["error"], results
    assert client.lease_state()["torn"] == f"step-{step}-torn"
    with pytest.raises(ExecutionError, match=f"{TORN}.*'step-{step}-torn'"):
        client.greedy(PROMPTS[:1])  # refused, never a mixed answer
    with pytest.raises(ExecutionError, match=TORN):
        client.prompt_logprobs(PROMPTS[:1])

    open_group(cluster.trainers, TP2, [cluster.tp2])  # (init again after a failed refit)
    results = refit_all(cluster.trainers, f"step-{step}", ["tp2"])  # lands whole: the fence lifts
    assert _ok(results, "tp2"), results
    cluster.step = step  # (the replicas stay a step behind: the later tests refit them)
    assert client.lease_state()["torn"] is None and client.weight_version() == f"step-{step}"
    assert client.greedy(PROMPTS) == cluster.reference(step), "after the fence lifted: not the reference's tokens"


@SLOW
def test_a_killed_engine_fails_its_group_only_and_a_new_one_is_refit_without_restarting_trainers(cluster):
    step = cluster.step + 1
    ray.get([t.train_step.remote(step) for t in cluster.trainers])
    kill_engine(cluster.tp2)
    t0 = time.monotonic()
    results = refit_all(cluster.trainers, f"step-{step}")
    assert time.monotonic() - t0 < TIMEOUT + 60
    assert _ok(results, "replicas"), results  # the other group is not affected
    assert not _ok(results, "tp2")
    error = results[0]["tp2"]["error"]
    assert "engine tp2" in error and "is gone" in error, error
    cluster.step = step
    want = cluster.reference(step)
    for k in range(2):
        assert RayEngineClient(cluster.replicas[k], "r").greedy(PROMPTS) == want
    # a new engine actor (from the first checkpoint) joins the same trainers; their plan is reused
    cluster.tp2 = start_engine(str(cluster.ckpts[0]), 2)
    opened = open_group(cluster.trainers, TP2, [cluster.tp2])
    assert opened[0]["compiles"] == results[0]["cache"]["compiles"], "re-opening the same layouts compiled again"
    results = refit_all(cluster.trainers, f"step-{step}", ["tp2"])
    assert _ok(results, "tp2"), results
    client = RayEngineClient(cluster.tp2, "tp2")
    assert client.greedy(PROMPTS) == want and client.weight_version() == f"step-{step}"


@SLOW
def test_a_killed_relay_fails_its_group_and_names_the_fan_out_tree(cluster):
    root = cluster.replicas[0]
    before = RayEngineClient(cluster.replicas[1], "replica 1").weight_version()
    kill_engine(root)
    results = refit_all(cluster.trainers, f"step-{cluster.step}-again", ["replicas"])
    assert not _ok(results, "replicas")
    error = results[0]["replicas"]["error"]
    assert "replica 0" in error and "replica 0 relays to replicas [1]" in error, error
    assert RayEngineClient(cluster.replicas[1], "replica 1").weight_version() == before
    cluster.replicas[0] = start_engine(str(cluster.ckpts[0]), 1)
    open_group(cluster.trainers, REPLICAS, cluster.replicas)
    results = refit_all(cluster.trainers, f"step-{cluster.step}", ["replicas"])
    assert _ok(results, "replicas"), results
    assert RayEngineClient(cluster.replicas[0], "replica 0").greedy(PROMPTS) == cluster.reference(cluster.step)


@SLOW
def test_a_killed_trainer_leaves_every_engine_on_its_previous_weights_and_new_trainers_continue(cluster):
    clients = cluster.clients()
    before = {n: (c.greedy(PROMPTS), c.weight_version(), c.weight_checksums()) for n, c in clients.items()}
    step = cluster.step + 1
    ray.get([t.train_step.remote(step) for t in cluster.trainers])
    cluster.trainers[1].exit.remote()  # dies as the refit begins
    t0 = time.monotonic()
    out = ray.get(cluster.trainers[0].refit.remote(f"step-{step}"))
    assert time.monotonic() - t0 < 2 * TIMEOUT + 60
    assert '"ok": false' in out
    for name, c in clients.items():
        assert (c.greedy(PROMPTS), c.weight_version(), c.weight_checksums()) == before[name], name
    # the loop goes on with new trainer actors, holding the weights of the step they were at
    ray.kill(cluster.trainers[0])
    cluster.trainers = start_trainers(2, {"tp": 2, "checkpoint": str(cluster.ckpts[step])})
    open_group(cluster.trainers, REPLICAS, cluster.replicas)
    open_group(cluster.trainers, TP2, [cluster.tp2])
    results = refit_all(cluster.trainers, f"step-{step}")
    assert _ok(results, "replicas") and _ok(results, "tp2"), results
    cluster.step = step
    for name, c in clients.items():
        assert c.greedy(PROMPTS) == cluster.reference(step) and c.weight_version() == f"step-{step}", name


def test_adding_a_replica_recompiles_only_the_plans_it_changes(cluster):
    """A third replica joins the replicas' group: the trainers and the replicas compile that group's new plan
    once; the TP2 engine, whose plan did not change, compiles nothing; egress stays one copy (fan-out)."""
    tp2_before = [s["compiles"] for s in RayEngineClient(cluster.tp2, "tp2").stats()]
    third = start_engine(str(cluster.ckpts[0]), 1)
    cluster.replicas.append(third)
    trainer_before = json_cache(cluster)
    opened = open_group(cluster.trainers, {**REPLICAS, "dst": {"tp": 1, "replicas": 3}}, cluster.replicas)
    assert [o["compiles"] for o in opened] == [c + 1 for c in trainer_before]
    results = refit_all(cluster.trainers, f"step-{cluster.step}")
    assert _ok(results, "replicas") and _ok(results, "tp2"), results
    model_bytes = sum(v.numel() * v.element_size() for v in load_checkpoint(cluster.ckpts[0]).values())
    assert sum(r["replicas"]["bytes_sent"] for r in results) == model_bytes
    want = cluster.reference(cluster.step)
    for k, e in enumerate(cluster.replicas):
        client = RayEngineClient(e, f"replica {k}")
        assert client.greedy(PROMPTS) == want and client.weight_version() == f"step-{cluster.step}"
    assert [s["compiles"] for s in RayEngineClient(cluster.tp2, "tp2").stats()] == tp2_before


def json_cache(cluster) -> list[int]:
    import json

    return [json.loads(x)["compiles"] for x in ray.get([t.cache_stats.remote() for t in cluster.trainers])]
