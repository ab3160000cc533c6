"""The rendezvous and the collective transport's group across two hosts (tests/testbed): what every cross-process
path of reshard stands on. A store hosted where nothing names its address is found by a member on the other host
and a gloo group forms over it; a store published at a loopback address fails the member at once, naming the
address; gloo's own default device (the host name, loopback in these namespaces as on many nodes) is shown to fail
across the hosts, which is why reshard binds its groups to the discovered address."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multihost

JOB = str(Path(__file__).with_name("store_job.py"))


def _run(two_hosts, tmp_path, wait: float = 120.0, **job):
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"timeout": 20.0, **job}))
    procs = [two_hosts.start(two_hosts.a, [sys.executable, JOB, str(path), "host"]),
             two_hosts.start(two_hosts.b, [sys.executable, JOB, str(path), "member"])]
    for p in procs:
        p.wait(wait)
    return [json.loads(path.with_suffix(f".{role}.json").read_text()) for role in ("host", "member")]


def test_store_and_gloo_group_across_hosts_at_discovered_addresses(two_hosts, tmp_path):
    host, member = _run(two_hosts, tmp_path)
    assert "error" not in host and "error" not in member, (host, member)
    assert host["address"] == two_hosts.a.address  # found, not configured
    assert host["max"] == member["max"] == 2.0


def test_a_loopback_store_address_fails_the_other_host_at_once_naming_it(two_hosts, tmp_path):
    host, member = _run(two_hosts, tmp_path, host="127.0.0.1")
    assert "error" in member, member
    assert "127.0.0.1" in member["error"] and "loopback" in member["error"], member["error"]
    assert member["seconds"] < 5.0, member  # refused at once, not after the store's 20 s
    assert "error" in host  # its member never came (bounded by the rendezvous timeout)


def test_gloo_default_device_fails_across_these_hosts(two_hosts, tmp_path):
    """The negative control: the test bed reproduces what a cluster node whose host name resolves to loopback does
    to gloo's default device."""
    host, member = _run(two_hosts, tmp_path, 60.0, gloo_default=True, timeout=4.0)
    assert "error" in host or "error" in member, (host, member)
