"""ReshardCheckpointEngine across two hosts (tests/testbed): NeMo-RL's policy workers on host A, its vLLM workers on
host B, driven in NeMo-RL's call order by the same job as tests/integration/nemo_rl (harness.nemo_rl_jobs),
with a config that names no host.

Each process of the job runs in its host's network namespace, started without RESHARD_HOST or GLOO_SOCKET_IFNAME:
the harness's own world (its stand-in for NeMo-RL's driver gathering results over Ray) binds each host's interface
only while it is made (reshard.testing.world), so the engines' stores and gloo groups find their addresses by reshard's own
discovery. Ground truth: the tensors a rollout worker on B yields equal, byte for byte, the checkpoint's tensors
after the same training steps, computed in that process from the checkpoint file.

The two failures users met on real clusters, reproduced: the old guide's `host: <one node's address>` is refused
at once on the other node, naming the address; a store published at a loopback address (RESHARD_HOST=127.0.0.1 on
the policy node only) fails the vLLM workers within seconds, naming it, instead of after the store's timeout. And
RESHARD_HOST naming another node's address is refused on the node where it is set, naming it.
"""
from __future__ import annotations

import subprocess

import pytest

from reshard.testing.megatron_cpu import TinyGPT
from harness.serve_jobs import make_checkpoint
from reshard.testing.world import run_world

pytestmark = pytest.mark.multihost

JOB = "harness.nemo_rl_jobs:nemo_rl_worker"
T, R = 2, 2  # policy workers on A, vLLM workers on B (the machine has 2 cores)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The dense TinyGPT, on the filesystem both hosts share."""
    return str(make_checkpoint(TinyGPT(), tmp_path_factory.mktemp("nemo-rl-2h") / "dense"))


def _run(two_hosts, tmp_path, checkpoint, env_a=None, env_b=None, steps=2, **job):
    """The job with processes 0..T-1 on host A and T..T+R-1 on host B (`env_a`, `env_b`: added to their
    environments); every process's result."""
    def launch(rank: int, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        host, extra = (two_hosts.a, env_a or {}) if rank < T else (two_hosts.b, env_b or {})
        return two_hosts.start(host, argv, {**env, **extra}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)

    job = {"checkpoint": checkpoint, "policy": T, "rollout": R, "steps": steps, "dir": str(tmp_path), **job}
    interfaces = [two_hosts.a.interface] * T + [two_hosts.b.interface] * R
    results = run_world(T + R, JOB, job, tmp_path, timeout=240, launch=launch, interfaces=interfaces)
    assert all(r is not None for r in results), (tmp_path / "logs.txt").read_text()[-4000:]
    for r in results:
        assert r["gloo_socket_ifname"] is None, r  # the harness's device choice did not reach the job
    return results[:T], results[T:]


def test_policy_on_one_host_refits_rollout_workers_on_another_byte_for_byte(two_hosts, tmp_path, checkpoint):
    policy, rollout = _run(two_hosts, tmp_path, checkpoint, bucket_size=20_000)
    for r in [*policy, *rollout]:
        assert "construct_error" not in r and "meet_error" not in r, r
        assert r["store_host"] == two_hosts.a.address  # policy worker 0's store, at the address it found itself
    for r in rollout:
        assert [e["step"] for e in r["refits"]] == [1, 2]
        for entry in r["refits"]:
            assert "error" not in entry, entry
            assert entry["equal"], entry["wrong"]
            assert len(entry["batches"]) > 1
            assert all(b["bytes"] <= 20_000 for b in entry["batches"] if len(b["names"]) > 1)
    sent = [p["refits"][-1]["bytes_sent"] for p in policy]
    assert all(s > 0 for s in sent) and max(sent) < 0.75 * sum(sent)  # both policy workers send, about half each
    assert sum(sent) == R * rollout[0]["model_bytes"]  # every vLLM worker got the whole model, once


def test_the_old_guides_fixed_host_is_refused_at_once_on_the_other_node(two_hosts, tmp_path, checkpoint):
    """`host: <policy node's address>` (what the guide used to show) is an address of host A only: the vLLM
    workers on B refuse it when NeMo-RL constructs them, naming it, before any store or group exists."""
    policy, rollout = _run(two_hosts, tmp_path, checkpoint, steps=1,
                           engine_kwargs={"model": checkpoint, "host": two_hosts.a.address})
    for r in policy:
        assert "construct_error" not in r and not r["refits"], r  # valid on A; stopped because B failed
    for r in rollout:
        error = r.get("construct_error", "")
        assert error.startswith("ArgumentError") and two_hosts.a.address in error, r
        assert "not an address of this host" in error and "RESHARD_HOST" in error, error


def test_a_loopback_store_fails_the_rollout_workers_at_once_naming_it(two_hosts, tmp_path, checkpoint):
    """RESHARD_HOST=127.0.0.1 on the policy host only: policy worker 0 publishes its store at loopback, which
    policy worker 1 (same host) reaches and the vLLM workers on B cannot."""
    policy, rollout = _run(two_hosts, tmp_path, checkpoint, env_a={"RESHARD_HOST": "127.0.0.1"}, steps=1,
                           kwargs={"timeout": 15.0})
    for r in rollout:
        error = r.get("meet_error", "")
        assert "127.0.0.1" in error and "loopback" in error, r
        assert r["meet_seconds"] < 5.0, r  # refused at once, not after the store's 15 s
        assert not r["refits"]
    for r in policy:
        assert "meet_error" in r and not r["refits"], r  # its vLLM workers never came (bounded by the timeout)


def test_reshard_host_naming_another_node_is_refused_where_it_is_set(two_hosts, tmp_path, checkpoint):
    """The environment's override is checked like the config's: RESHARD_HOST=<A's address> on host B fails B's
    engines at prepare(), naming the variable and the address, and NeMo-RL's driver sees it from every worker."""
    policy, rollout = _run(two_hosts, tmp_path, checkpoint, env_b={"RESHARD_HOST": two_hosts.a.address}, steps=1)
    for r in rollout:
        error = r.get("meet_error", "")
        assert "RESHARD_HOST" in error and two_hosts.a.address in error and "not an address of this host" in error, r
        assert r["meet_seconds"] < 5.0 and not r["refits"], r
    for r in policy:
        assert "prepare failed on process 2" in r.get("meet_error", "") and not r["refits"], r
