"""Delta refits over the collective transport: `CollectiveExecutor(..., delta=DeltaPolicy(...))` (the protocol,
its encodings, its checks and its loop: executors.delta).

Per refit: one all-reduce decides, the same everywhere, whether this is a keyframe (any refusal, a sender due one,
or receivers and senders not holding one common base). A keyframe is the executor's own dense refit. A delta: each
sender encodes the changed elements of the ops it sends to each process; sizes travel first (one int64 message per
pair), then payloads (one uint8 message per pair). Receivers prove what arrived (and, with `checksum`, compare the
sender's digest of the resulting blocks) before anything is written; the executor's verify all-reduce then lets
receivers scatter in place and senders update their copies. A failure leaves every destination as it was (the
payloads are the only staging) and makes the next refit a keyframe.
"""
from __future__ import annotations

import time

import torch

from ...errors import ExecutionError
from ..base import RefitStats, phase_times
from ..delta import DeltaError, DeltaPolicy, VotedDelta
from ..partition import Partition
from ..preflight import refuse_disagreement

SIZE_TAG, PAYLOAD_TAG = (1 << 30) - 2, (1 << 30) - 3  # below the checksum exchange's tag, above every round's
NONE = 1 << 60  # a process with neither receiver nor sender stands aside in the version all-reduce


class CollectiveDelta(VotedDelta):
    """A CollectiveExecutor's delta refits (see the module docstring): executors.delta.VotedDelta's loop, the
    versions told by an all-reduce and the payloads moved over the group.

    Args:
        executor: the executor (its plan, binding, group, checks and dense refit).
        policy: the `DeltaPolicy`.

    Raises:
        ArgumentError: `policy` is not a DeltaPolicy.
        ExecutionError: the plan relays between replicas (fan-out): compile it without.
    """

    peer = "group rank {}"

    def __init__(self, executor, policy: DeltaPolicy) -> None:
        super().__init__(executor, policy, Partition(executor.plan, executor.binding, executor.rank),
                         executor.checksum)
        self.prepared, self.device = None, torch.device("cpu")  # this refit's tensors (executors.partition)

    def _flats(self) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        return self.prepared.src_flat, self.prepared.dst_flat

    def refit(self, start: float, src: dict, dst: dict, version: int | None) -> RefitStats:
        """One refit, delta or keyframe as every process decides together (module docstring)."""
        ex = self.ex
        new = ex._version + 1 if version is None else int(version)
        self.prepared, self.device, problem = ex._prepare(src, dst)
        keyframe = self._decide(problem, new)
        marks = [("decide", time.perf_counter())]
        try:
            if not keyframe:
                return self._delta(start, marks, new)
            stats = ex._run(start, src, dst, new)
        except Exception:
            self._forget()
            raise
        self.commit()
        return stats

    def _decide(self, problem: str | None, new: int) -> bool:
        """Whether this refit is a keyframe, the same on every process; raises if a process refused its tensors."""
        ex = self.ex
        # the version this process's receiver holds and its sender's copy is of (-1: unknown), voted as MAX and -MIN
        mine = [-1 if v is None else v for v in ([] if self.receiver is None else [self.receiver.held])
                + ([] if self.sender is None else [self.sender.base])]
        due = int(self.sender is not None and self.sender.keyframe_due(self.policy))
        fp = ex._fingerprint ^ self.policy.keyframe_every
        t = [int(problem is not None), fp, -fp, max(mine, default=-NONE), -min(mine, default=NONE), due]
        bad, hi, lo, most, least, due = ex._vote(t, self.device, "delta preflight", before=True)
        refuse_disagreement(problem, bad, hi == -lo, "plan, binding and delta policy")
        return self._start(new, bool(due), {x if x >= 0 else None for x in (most, -least)})

    def _delta(self, start: float, marks: list, new: int) -> RefitStats:
        payloads = self._encode(new)
        marks.append(("encode", time.perf_counter()))
        arrived = self._move(payloads, new, 0.0)
        marks.append(("exchange", time.perf_counter()))
        problem = None
        try:
            self._prove(arrived)
        except DeltaError as e:
            problem = str(e)
        except RuntimeError as e:  # e.g. CUDA out of memory expanding the indices: voted, so that the peers hear of
            problem = f"reading the deltas failed: {type(e).__name__}: {e}"  # it now rather than at their timeout
        self.ex._agree(self.device, problem)
        marks.append(("verify", time.perf_counter()))
        self.commit()
        marks.append(("apply", time.perf_counter()))
        self.ex._version = new
        return self.stats(new, *phase_times(start, marks), staging_bytes=sum(self.received.values()))

    def _move(self, payloads: dict[int, torch.Tensor], v: int, deadline: float) -> dict[int, torch.Tensor]:
        """Every payload to its process (sizes first, then the bytes); the payloads that arrived, by sender."""
        ex, me, device = self.ex, self.me, self.device
        arrived = {me: payloads[me]} if me in payloads else {}
        if ex.size == 1:
            return arrived
        sizes_out = {p: torch.tensor([t.numel()], dtype=torch.int64, device=device)
                     for p, t in payloads.items() if p != me}
        sizes_in = {p: torch.zeros(1, dtype=torch.int64, device=device) for p in self.feeders}
        ex._exchange([(t, p, SIZE_TAG) for p, t in sizes_out.items()],
                     [(t, p, SIZE_TAG) for p, t in sizes_in.items()], "the delta sizes did not arrive")
        for p, t in sizes_in.items():
            n = int(t.item())
            if not 0 <= n <= 1 << 40:
                raise ExecutionError(f"group rank {p} announced a delta of {n} bytes; nothing was written")
            arrived[p] = torch.empty(n, dtype=torch.uint8, device=device)
            self.received[p] = n
        ex._exchange([(payloads[p], p, PAYLOAD_TAG) for p in sizes_out if payloads[p].numel()],
                     [(arrived[p], p, PAYLOAD_TAG) for p in sizes_in if arrived[p].numel()],
                     "the delta payloads did not arrive")
        return arrived

    def _forget(self) -> None:
        if self.sender is not None:
            self.sender.forget()
        if self.receiver is not None:
            self.receiver.held = None


__all__ = ["CollectiveDelta"]
