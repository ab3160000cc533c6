"""reshard.addresses: the rule that picks the address other hosts reach a process at, on data (choose), and its
checks against this host's real sockets (an override must be bindable here; a probe of a closed port fails at once
naming the address). Discovery inside real network namespaces and Ray: tests/multihost."""
from __future__ import annotations

import socket
import time

import pytest

from harness.interfaces import interface_of
from reshard import addresses
from reshard.errors import ArgumentError, ExecutionError


@pytest.mark.parametrize("found,default,want", [
    ({"lo": "127.0.0.1", "eth0": "10.0.0.5"}, "eth0", "10.0.0.5"),
    ({"lo": "127.0.0.1", "eth0": "10.0.0.5", "ib0": "192.168.7.2"}, "ib0", "192.168.7.2"),  # the default route's
    ({"lo": "127.0.0.1", "veth1": "10.9.0.2"}, None, "10.9.0.2"),  # no default route, one candidate
    ({"lo": "127.0.0.1", "b1": "10.1.0.1", "a1": "10.2.0.1"}, None, "10.2.0.1"),  # several: first by name
    ({"lo": "127.0.0.1", "eth0": "10.0.0.5"}, "lo", "10.0.0.5"),  # a default route on loopback is not routable
    ({"lo": "127.0.0.1"}, "lo", None),  # loopback only
    ({}, None, None),
])
def test_choose_prefers_the_default_route_and_never_loopback(found, default, want):
    assert addresses.choose(found, default) == want


def test_an_override_must_be_an_address_of_this_host(monkeypatch):
    monkeypatch.delenv(addresses.ENV, raising=False)
    assert addresses.routable_address("127.0.0.1") == "127.0.0.1"
    with pytest.raises(ArgumentError, match=r"host.*203\.0\.113\.9.*not an address of this host"):
        addresses.routable_address("203.0.113.9")  # TEST-NET-3: no host here has it
    monkeypatch.setenv(addresses.ENV, "203.0.113.9")
    with pytest.raises(ArgumentError, match="RESHARD_HOST"):
        addresses.routable_address()


def test_without_an_override_the_address_is_not_loopback_where_another_interface_exists(monkeypatch):
    monkeypatch.delenv(addresses.ENV, raising=False)
    found = addresses.routable_address()
    others = [a for a in addresses.interfaces().values() if not addresses.is_loopback(a)]
    assert (found in others) if others else found == "127.0.0.1"
    addresses.check_local(found)  # and a store can listen there


def test_interface_of_names_the_interface_holding_an_address():
    for name, address in addresses.interfaces().items():
        assert interface_of(address) == name
    assert interface_of("203.0.113.9") is None


def test_probe_fails_at_once_naming_a_closed_loopback_address():
    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(ExecutionError, match=rf"127\.0\.0\.1:{port}.*refused.*loopback"):
            addresses.probe("127.0.0.1", port, 60.0, "the refit's store")
        assert time.monotonic() - start < 5.0  # no retries until the 60 s


def test_probe_passes_a_listening_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        addresses.probe("127.0.0.1", s.getsockname()[1], 5.0, "a store")


def test_is_loopback():
    assert addresses.is_loopback("127.0.0.1") and addresses.is_loopback("127.3.2.1")
    assert addresses.is_loopback("localhost") and addresses.is_loopback("::1")
    assert not addresses.is_loopback("10.0.0.1")
