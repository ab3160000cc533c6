"""JSON from one member of a torch.distributed group to every member (never pickle), bounded by the caller's
timeout rather than the group's (which may wait 30 minutes on a dead peer)."""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from .errors import ExecutionError


def broadcast_json(value: Any, group: Any = None, timeout: float = 300.0, what: str = "a JSON broadcast",
                   src: int = 0) -> Any:
    """Rank `src`'s `value` (JSON-able) on every member of `group`, as JSON bytes in tensors.

    Args:
        value: what rank `src` sends (other ranks' values are ignored).
        group: the process group (None: the default; outside torch.distributed or alone, `value` is returned).
        timeout: seconds each of the two broadcasts may take.
        what: names the broadcast in errors.
        src: the sending member's rank in `group`.
    Returns:
        rank `src`'s value, decoded from JSON (so tuples come back as lists).
    Raises:
        ExecutionError: a broadcast that did not complete within `timeout`, a size over 16 MiB, bytes not JSON.
    """
    import json

    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend(group)) \
        else torch.device("cpu")
    root = src if group is None or group is dist.group.WORLD else dist.get_global_rank(group, src)
    data = json.dumps(value).encode() if value is not None and dist.get_rank() == root else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    bounded_wait(dist.broadcast(size, root, group=group, async_op=True), timeout, what)
    if not 0 <= int(size.item()) <= 1 << 24:
        raise ExecutionError(f"{what}: a size of {int(size.item())} bytes (at most 16 MiB of JSON)")
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if data:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    bounded_wait(dist.broadcast(buf, root, group=group, async_op=True), timeout, what)
    try:
        return json.loads(bytes(buf.cpu().tolist()).decode()) if int(size.item()) else None
    except ValueError as e:
        raise ExecutionError(f"{what}: not JSON ({e})") from None


def bounded_wait(work: Any, timeout: float, what: str) -> None:
    """Wait for a collective at most `timeout` seconds; ExecutionError naming `what` otherwise."""
    try:
        work.wait(timedelta(seconds=timeout))
    except RuntimeError as e:  # gloo's and NCCL's timeouts, and a peer that went away
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ExecutionError(f"{what} did not arrive within {timeout:.0f} s ({first})") from None


__all__ = ["bounded_wait", "broadcast_json"]
