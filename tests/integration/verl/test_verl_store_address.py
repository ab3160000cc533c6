"""build_topology's check of the store address on every rank's prepare() metadata (pure data; the two-host run is
test_verl_multihost.py): a loopback store with every rank on trainer rank 0's host is fine (the single-host tests
run so), one with a rank on another host is refused naming the address, what set it and the ranks elsewhere."""
from __future__ import annotations

import pytest

from reshard.errors import ArgumentError
from reshard.integrations.verl.topology import check_store_address

pytestmark = pytest.mark.verl

A = {"id": "node-a", "address": "10.0.0.1"}
B = {"id": "node-b", "address": "10.0.0.2"}


def metadata(store: str, nodes: list[dict], source: str = "discovered") -> list[dict]:
    master = {"role": "trainer", "master": True, "node": nodes[0], "rendezvous": {"host": store},
              "host_source": source}
    return [master] + [{"role": "x", "master": False, "node": n} for n in nodes[1:]]


def test_loopback_on_one_host_and_routable_across_hosts_pass():
    check_store_address(2, metadata("127.0.0.1", [A, A, A]))
    check_store_address(2, metadata("10.0.0.1", [A, A, B, B]))
    check_store_address(1, metadata("127.0.0.1", [{"id": None, "address": None}, B]))  # unknown: nothing to refuse


def test_loopback_with_ranks_on_another_host_is_refused_naming_it():
    with pytest.raises(ArgumentError) as refused:
        check_store_address(2, metadata("127.0.0.1", [A, A, B, B, B], "engine_kwargs.reshard.host"))
    text = str(refused.value)
    assert text.startswith("engine_kwargs.reshard.host='127.0.0.1'") and "loopback" in text, text
    assert "rollout rank 0, rollout rank 1, rollout rank 2" in text and "10.0.0.2" in text, text
    # the Ray node id decides over the address (two hosts can report the same address through RESHARD_HOST)
    with pytest.raises(ArgumentError, match="trainer rank 1"):
        check_store_address(2, metadata("localhost", [A, {"id": "node-c", "address": "10.0.0.1"}], "RESHARD_HOST"))
