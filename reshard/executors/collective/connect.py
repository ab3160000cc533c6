"""First use of NCCL communicators, off the calling thread and bounded by the timeout.

NCCL connects lazily (rings at the first collective, a pair's channels at its first message) and the posting call
blocks the host meanwhile, for good if the peer is gone. So the executor makes every first use here, right after
the preflight showed every member alive: the first all-reduce of a group, and a handshake (one element each way)
with every peer on every lane, on a helper thread waited for at most `timeout`. Connected pairs are remembered
per process, so later refits post on the calling thread.
"""
from __future__ import annotations

import time
from typing import Callable, TypeVar

import torch

from ...errors import ExecutionError
from ...polling import Background

T = TypeVar("T")
# (id(communicator), global peer rank; -1 for its collectives) -> the communicator, kept so that its id is not
# reused by another group while it is listed here
_READY: dict[tuple[int, int], object] = {}


def ready(comm, peer: int = -1) -> bool:
    """Whether this process has already connected `comm` to `peer` (a global rank; -1: its collectives)."""
    return (id(comm), peer) in _READY


def mark_ready(comms: list, peers: list[int]) -> None:
    """Remember that every one of `comms` is connected to every one of `peers` (-1: its collectives)."""
    _READY.update({(id(c), p): c for c in comms for p in peers})


def forget(comms: list) -> None:
    """Drop what is known of these communicators (aborted, or about to be)."""
    ids = {id(c) for c in comms}
    for key in [k for k in _READY if k[0] in ids]:
        del _READY[key]


def off_thread(fn: Callable[[], T], timeout: float, device: torch.device, what: str) -> T:
    """fn() on a helper thread (same device, same current stream); ExecutionError if it has not returned
    within `timeout` seconds (the thread is left behind: a daemon stuck in NCCL)."""
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def target() -> T:
        if stream is None:
            return fn()
        torch.cuda.set_device(device)
        with torch.cuda.stream(stream):
            return fn()

    call = Background(target, name="reshard-connect")
    if not call.join(time.monotonic() + timeout):
        raise ExecutionError(f"{what} did not return within {timeout:.1f} s (NCCL waits for a peer while it "
                             f"connects to it: a peer is gone or stuck)")
    if call.error is not None:
        raise call.error
    return call.value


def handshake(comm, peers: list[int], device: torch.device) -> list:
    """Post one element to and from every peer (group ranks) on every lane of `comm`, which connects each pair
    (peers are symmetric, so every message has its match)."""
    buf = torch.zeros(2 * max(len(peers), 1), dtype=torch.int32, device=device)
    works = []
    for lane in range(len(comm.lanes)):
        works += comm.post(comm.prepare(lane, [(buf[2 * i:2 * i + 1], p, 0) for i, p in enumerate(peers)],
                                        [(buf[2 * i + 1:2 * i + 2], p, 0) for i, p in enumerate(peers)]))
    return works


__all__ = ["forget", "handshake", "mark_ready", "off_thread", "ready"]
