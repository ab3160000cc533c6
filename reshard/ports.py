"""A TCP port to hand to another process (torch.distributed's MASTER_PORT, a server's --port).

Asking the OS (bind to port 0) and closing the socket leaves a window in which any process's next OS-assigned port
-- an outgoing connection, or another `bind(0)` such as vLLM's own `get_open_port` -- can be that very port; CI saw
a vLLM rank's TCPStore fail with EADDRINUSE that way. Ports are therefore drawn at random from below the kernel's
ephemeral range, which the OS never assigns by itself, and checked free by a bind."""
from __future__ import annotations

import random
import socket
from pathlib import Path

from .errors import ArgumentError, ExecutionError

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 20000  # above common services and Ray's worker ports (10000-19999), which Ray binds itself later
_TRIES = 64


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for OS-assigned ports.

    Returns:
        (lowest, highest) from /proc/sys/net/ipv4/ip_local_port_range; Linux's default (32768, 60999) where that
        file cannot be read.
    """
    try:
        low, high = (int(x) for x in _EPHEMERAL_RANGE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "0.0.0.0") -> int:
    """A TCP port on `host` that is free now and that no OS-assigned port will take before its user binds it.

    Args:
        host: the address the port's user will bind (an IP address or a host name; "0.0.0.0", the default:
            every IPv4 address of this host, so the port is free whichever one its user binds).

    Returns:
        A port below the kernel's ephemeral range (and above Ray's worker ports), checked free by a bind. Only
        another caller of `free_port` could draw the same one meanwhile (odds about 1 in 12,000 per pair).

    Raises:
        ArgumentError: `host` is not a non-empty string.
        ExecutionError: no such port was free after 64 random tries.
    """
    if not isinstance(host, str) or not host:
        raise ArgumentError(f"free_port: host must be a non-empty string, got {host!r}")
    low, high = ephemeral_range()
    candidates = [(_LOWEST, low - 1), (high + 1, 65535)]
    candidates = [(a, b) for a, b in candidates if b - a >= 1000]
    if not candidates:  # the ephemeral range covers almost everything: the OS's own choice is all there is
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    rng = random.SystemRandom()
    for _ in range(_TRIES):
        a, b = rng.choice(candidates)
        port = rng.randint(a, b)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    raise ExecutionError(f"no free TCP port on {host} in {candidates} after {_TRIES} random tries")


__all__ = ["ephemeral_range", "free_port"]
