"""Delta refits over NIXL: `NixlExecutor(..., delta=DeltaPolicy(...))`, CPU tensors (DRAM).

The protocol is executors.delta.VotedDelta's. Its transport: every sender registers an outbox per receiving peer
and every receiver an inbox per feeder, each of `payload_bound` bytes; the receiver's book publishes its inboxes.
A sender WRITEs only the payload's bytes into the receiver's inbox (a transfer made for that size); the store
carries the size, and the receiver reads the inbox in place once the WRITE's notification arrived.
"""
from __future__ import annotations

from typing import Any

import torch

from ...errors import ExecutionError
from ...planner.plan import RELAY
from ...polling import poll
from ..checksum import algorithm
from ..delta import DeltaError, DeltaPolicy, VotedDelta, payload_bound
from ..partition import Partition


class NixlDelta(VotedDelta):
    """A NixlExecutor's delta refits (module docstring): its payload buffers, registered with the executor's.

    Raises:
        ExecutionError: GPU tensors, or a plan with fan-out relays.
    """

    def __init__(self, executor: Any, policy: DeltaPolicy) -> None:
        plan = executor.plan
        if executor.device.type != "cpu":
            raise ExecutionError("delta refits over NIXL run on CPU tensors (GPUs: the collective executor's delta "
                                 "option)")
        if plan.num_ops and bool((plan.ops["src_side"] == RELAY).any()):
            raise ExecutionError("delta refits need a plan without fan-out (relays between replicas); compile it "
                                 "without fanout")
        part = Partition(plan, executor.binding, executor.process)
        super().__init__(executor, policy, part, algorithm(executor.options.checksum))
        self.outbox = {q: torch.empty(payload_bound(plan, ops), dtype=torch.uint8) for q, ops in part.sends_to.items()}
        self.inbox = {f: torch.empty(payload_bound(plan, ops), dtype=torch.uint8)
                      for f, ops in part.receives_from.items()}
        self.notified: set[bytes] = set()  # the WRITE notifications that arrived (_landed)

    def book(self) -> dict[str, Any]:
        """What this process's address book says about its delta refits: the policy and its inboxes."""
        return {"delta": self.policy.keyframe_every,
                "delta_inbox": {str(f): t.data_ptr() for f, t in self.inbox.items()}}

    def buffers(self) -> list[torch.Tensor]:
        """The payload buffers (uint8), registered with the executor's memory and kept alive after a failure."""
        return [*self.outbox.values(), *self.inbox.values()]

    def deliver(self, q: int, payload: torch.Tensor, v: int, deadline: float) -> dict[str, Any]:
        n, box, me = payload.numel(), self.outbox[q], self.ex.process
        if n > box.numel():
            raise ExecutionError(f"a delta of {n} bytes for process {q} exceeds its buffer of {box.numel()}")
        box[:n].copy_(payload)
        remote = self.ex.connection.books[q].get("delta_inbox", {}).get(str(me))
        if remote is None:
            raise ExecutionError(f"process {q} exposes no delta inbox for process {me}")
        self.ex.connection.write(q, box.data_ptr(), int(remote), n, _landed(v, me), deadline, self.ex.poll_max_s,
                                 f"the delta of refit {v}")
        return {}

    def arrived(self, f: int, where: dict[str, Any], n: int, v: int, deadline: float) -> torch.Tensor:
        box = self.inbox[f]
        if n > box.numel():
            raise DeltaError(f"process {f} announced a delta of {n} bytes, more than its inbox of {box.numel()}; "
                             f"nothing was written")
        want = _landed(v, f)

        def landed() -> bool:  # other messages now are a dense refit's stale ones, which it drops too
            self.notified.update(m for m in self.ex.connection.notifications() if m.startswith(b"X"))
            return want in self.notified

        if not poll(landed, deadline, first_s=2e-5, most_s=self.ex.poll_max_s):
            raise ExecutionError(f"timed out waiting for process {f}'s delta to land (its WRITE's notification)")
        self.notified.discard(want)
        return box[:n]


def _landed(v: int, sender: int) -> bytes:
    """The notification of sender's delta WRITE of refit `v`."""
    return f"X{v}:{sender}".encode()


__all__ = ["NixlDelta"]
