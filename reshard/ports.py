"""A TCP port to hand to another process (torch.distributed's MASTER_PORT, a server's --port).

Asking the OS (bind to port 0) and closing the socket leaves a window in which any process's next OS-assigned port
-- an outgoing connection, or another `bind(0)` such as vLLM's own `get_open_port` -- can be that very port; CI saw
a vLLM rank's TCPStore fail with EADDRINUSE that way. Ports are therefore drawn at random from below the kernel's
ephemeral range, which the OS never assigns by itself, and checked free by a bind."""
from __future__ import annotations

import random
import socket
from pathlib import Path

from .errors import ExecutionError

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 20000  # above the registered ports that services commonly listen on
_TRIES = 64


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for OS-assigned ports (Linux's default where /proc does not say)."""
    try:
        low, high = (int(x) for x in _EPHEMERAL_RANGE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` free now and outside the ephemeral range (so no OS-assigned port takes it before its user
    binds it). Raises ExecutionError when no such port is free after a few random tries."""
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
