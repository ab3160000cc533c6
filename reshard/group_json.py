"""JSON from rank 0 of a trainer's process group to every member, over the group's own collectives (never pickle),
each step bounded by the caller's timeout rather than the group's (a user's group may wait 30 minutes on a dead
peer)."""
from __future__ import annotations

from typing import Any

import torch

from ..errors import ExecutionError


def broadcast_json(value: Any, group: Any, timeout: float, what: str) -> Any:
    """`value` from the group's rank 0 to every member, as JSON bytes in tensors (never pickle), each step bounded
    by `timeout` (the session's, not the group's own: a user's group may wait 30 minutes on a dead peer)."""
    import json

    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend(group)) \
        else torch.device("cpu")
    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    data = json.dumps(value).encode() if value is not None else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    bounded_wait(dist.broadcast(size, src, group=group, async_op=True), timeout, what)
    if not 0 <= int(size.item()) <= 1 << 24:
        raise ExecutionError(f"{what}: a size of {int(size.item())} bytes (at most 16 MiB of JSON)")
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if data:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    bounded_wait(dist.broadcast(buf, src, group=group, async_op=True), timeout, what)
    try:
        return json.loads(bytes(buf.cpu().tolist()).decode())
    except ValueError as e:
        raise ExecutionError(f"{what}: not JSON ({e})") from None


def bounded_wait(work: Any, timeout: float, what: str) -> None:
    """Wait for a collective at most `timeout` seconds; ExecutionError naming `what` otherwise."""
    from datetime import timedelta

    try:
        work.wait(timedelta(seconds=timeout))
    except RuntimeError as e:  # gloo's and NCCL's timeouts, and a peer that went away
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ExecutionError(f"{what} did not arrive within {timeout:.0f} s ({first})") from None


__all__ = ["bounded_wait", "broadcast_json"]
