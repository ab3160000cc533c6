"""verl's manager path across two hosts (tests/testbed/two_hosts.py): verl's real CheckpointEngineManager, with 2
trainer workers (ActorRolloutRefWorker.update_weights over a megatron-core MoE) on host A and 3 rollout workers
(CheckpointEngineWorker) on host B, the driver on host A, and no `host` in the reshard backend's config: trainer
rank 0 publishes the address its Ray node is reached at, and every rollout worker serves, byte for byte, the
trainer's HF tensors after each of two refits with training steps between them.

The failure users met before addresses were discovered: `host: "127.0.0.1"` in engine_kwargs.reshard. Trainer rank 0
can host a store there, trainer rank 1 (same host) joins it, but host B's rollout workers cannot reach it. Without
build_topology's check (measured here with it disabled in the driver) verl's update_weights still raised within
0.1 s, with the rollout side's error (its probe names 127.0.0.1 and says loopback), but the trainer ranks, which no
one could tell through a store the rollout side cannot reach, stayed in the rendezvous until its timeout (300 s by
default), and the next call to them (here: reading their weights' digests) waited that long. build_topology, in the
driver, sees every rank's node in its metadata and refuses the refit before any process joins, naming the address,
the key that set it and the ranks elsewhere; the same workers answer and refit with the discovered address at once.

One Ray cluster and one driver job for the module (the machine has 2 cores); each test reads its part of the job's
record.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.multihost]

JOB = str(Path(__file__).with_name("verl_multihost_job.py"))
DEFAULT_TIMEOUT = 300.0  # the backend's `timeout` when the config sets none (ReshardCheckpointEngine)


@pytest.fixture(scope="module")
def record(two_hosts, tmp_path_factory):
    from harness import verl_cpu as vc

    work = tmp_path_factory.mktemp("verl_multihost")
    checkpoint = str(vc.save_checkpoint(vc.MOE, work / "checkpoint"))
    env = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    with two_hosts.ray_cluster(python=sys.executable, cpus_a=4, cpus_b=4, log_dir=work, env=env) as address:
        job = work / "job.json"
        job.write_text(json.dumps({
            "address": address, "checkpoint": checkpoint, "options": {"timeout": 60.0},
            "steps": [{"step": 1}, {"step": 2},
                      # the backend's default timeout: the refusal must not be a timeout
                      {"step": 3, "options": {"host": "127.0.0.1"}},
                      {"step": 3, "options": {}}]}))
        driver = two_hosts.start(two_hosts.a, [sys.executable, JOB, str(job)], env,
                                 stdout=open(work / "driver.log", "w"), stderr=open(work / "driver.err", "w"))
        try:
            driver.wait(540)
        except Exception:  # noqa: BLE001 - a hung driver: what it wrote so far is examined below
            pass
        out = job.with_suffix(".out.json")
        assert out.exists(), f"the driver wrote nothing: {(work / 'driver.err').read_text()[-3000:]}"
        result = json.loads(out.read_text())
    result["hosts"] = {"a": two_hosts.a.address, "b": two_hosts.b.address}
    return result


def _served_exactly(refit: dict) -> None:
    assert "error" not in refit, refit["error"]
    expected = refit["expected"]
    for r, (version, digests) in enumerate(refit["served"]):
        assert version == refit["step"], f"rollout rank {r} serves step {version}, expected {refit['step']}"
        wrong = sorted(n for n in expected if digests.get(n) != expected[n])
        assert not wrong and set(digests) == set(expected), f"rollout rank {r}: {wrong[:5]} differ"


def test_refits_across_hosts_at_discovered_addresses(record):
    assert "error" not in record, record.get("trace", record["error"])
    hosts = record["hosts"]
    assert [w["node"] for w in record["trainers"]] == [hosts["a"]] * 2  # placed as asked
    assert [w["node"] for w in record["rollouts"]] == [hosts["b"]] * 3
    first, second = record["refits"][:2]
    for refit in (first, second):
        _served_exactly(refit)
        assert refit["trainers"][0]["store"] == hosts["a"]  # found, not configured
    assert first["expected"] != second["expected"]  # the training step changed the weights between refits


def test_loopback_host_is_refused_at_once_naming_it(record):
    assert "error" not in record, record.get("trace", record["error"])
    bad, after = record["refits"][2:4]
    print(f"refits (step, refit s, whole step s): "
          f"{[(r['step'], round(r['seconds'], 1), round(r['step_seconds'], 1)) for r in record['refits']]}; "
          f"workers shut down in {record.get('shutdown_seconds', -1):.1f} s")
    assert "error" in bad, "a store at 127.0.0.1 on host A was reported reachable from host B"
    assert bad["seconds"] < DEFAULT_TIMEOUT / 10, f"the refusal took {bad['seconds']:.0f} s"
    assert all(version == 2 for version, _ in bad["served"])  # nothing was handed on: still step 2's weights
    # no trainer was left waiting in a rendezvous: one that joined a store nobody else could reach answers the next
    # call only at the rendezvous timeout (the calls after the refit are in the step's time)
    assert bad["step_seconds"] < DEFAULT_TIMEOUT / 10, f"the failed step took {bad['step_seconds']:.0f} s in all"
    # the same workers refit at once with the address discovered
    assert after["step_seconds"] < DEFAULT_TIMEOUT / 10, f"the next step took {after['step_seconds']:.0f} s"
    _served_exactly(after)
    # refused in the driver, naming what set the address
    assert "127.0.0.1" in bad["error"] and "loopback" in bad["error"], bad["error"]
    assert "engine_kwargs.reshard.host" in bad["error"] and "rollout rank 0" in bad["error"], bad["error"]
