"""reshard.ports: ports handed to other processes are never ones the OS would assign by itself meanwhile."""
from __future__ import annotations

import socket

import pytest

from reshard import ports
from reshard.errors import ArgumentError


def test_free_ports_lie_outside_the_ephemeral_range_and_can_be_bound():
    low, high = ports.ephemeral_range()
    assert 0 < low <= high <= 65535
    for _ in range(50):
        port = ports.free_port()
        assert not low <= port <= high
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_not_handed_out(monkeypatch):
    busy = ports.free_port()
    other = next(p for p in iter(ports.free_port, None) if p != busy)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", busy))
        taken.listen()
        draws = [busy, busy, other]
        monkeypatch.setattr(ports.random.SystemRandom, "randint", lambda self, a, b: draws.pop(0))
        assert ports.free_port() == other
        assert draws == []


def test_an_ephemeral_range_covering_everything_falls_back_to_the_os(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    port = ports.free_port()
    assert 1024 <= port <= 65535


@pytest.mark.parametrize("host", [None, "", 5, b"127.0.0.1"])
def test_a_bad_host_is_refused(host):
    with pytest.raises(ArgumentError, match="host"):
        ports.free_port(host)
