"""A TCP port to hand to another process (MASTER_PORT, a server's --port), drawn at random from outside the
kernel's ephemeral range: a `bind(0)` port could be handed out again by the OS before its user binds it (CI saw
EADDRINUSE that way)."""
from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

from .arguments import text
from .errors import ExecutionError

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 20000  # above common services and Ray's worker ports (10000-19999), which Ray binds itself later
_TRIES = 64


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for OS-assigned ports, (lowest, highest); Linux's default where it cannot be read."""
    try:
        low, high = (int(x) for x in _EPHEMERAL_RANGE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "0.0.0.0") -> int:
    """A TCP port on `host` that is free now and that no OS-assigned port will take before its user binds it.

    Args:
        host: the address the port's user will bind (default "0.0.0.0": every IPv4 address of this host).

    Returns:
        A port outside the ephemeral range (and above Ray's worker ports), checked free by a bind.

    Raises:
        ArgumentError: `host` is not a non-empty string.
        ExecutionError: no such port was free after 64 random tries.
    """
    text("host", host)
    low, high = ephemeral_range()
    candidates = [(a, b) for a, b in [(_LOWEST, low - 1), (high + 1, 65535)] if b - a >= 1000]
    if not candidates:  # the ephemeral range covers almost everything: the OS's own choice is all there is
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    rng = random.SystemRandom()
    for _ in range(_TRIES):
        a, b = rng.choice(candidates)
        port = rng.randint(a, b)
        with socket.socket() as s, contextlib.suppress(OSError):  # taken: draw again
            s.bind((host, port))
            return port
    raise ExecutionError(f"no free TCP port on {host} in {candidates} after {_TRIES} random tries")


__all__ = ["ephemeral_range", "free_port"]
