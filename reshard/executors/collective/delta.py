"""Delta refits over the collective transport: `CollectiveExecutor(..., delta=DeltaPolicy(...))` (the protocol,
its encodings and its checks: executors.delta).

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

import numpy as np
import torch

from ...errors import ExecutionError
from ...planner.plan import RELAY
from ..delta import DeltaError, DeltaPolicy, DeltaReport, check_digest, check_policy, keyframe_report, source_digest
from ..partition import Partition
from ..preflight import refuse_disagreement
from ..base import RefitStats, phase_times

SIZE_TAG, PAYLOAD_TAG = (1 << 30) - 2, (1 << 30) - 3  # below the checksum exchange's tag, above every round's
NONE = 1 << 60  # a process with no receiver (sender) stands aside in the version all-reduce


class CollectiveDelta:
    """A CollectiveExecutor's delta refits (see the module docstring).

    Args:
        executor: the executor (its plan, binding, group, checks and dense refit).
        policy: the `DeltaPolicy`.

    Raises:
        ArgumentError: `policy` is not a DeltaPolicy.
        ExecutionError: the plan relays between replicas (fan-out): compile it without.
    """

    def __init__(self, executor, policy: DeltaPolicy) -> None:
        plan, me = executor.plan, executor.rank
        self.executor, self.policy = executor, check_policy(policy)
        if np.any(plan.ops["src_side"] == RELAY):
            raise ExecutionError("delta refits need a plan without fan-out (relays between replicas); compile it "
                                 "without fanout")
        part = Partition(plan, executor.binding, me)  # with no relays, an op's sender plays its source rank
        local = {me: part.local} if len(part.local) else {}
        self.sends = dict(sorted({**local, **part.sends_to}.items()))  # peer -> ops, this process's own included
        self.recvs = dict(sorted({**local, **part.receives_from}.items()))
        mine_out = np.flatnonzero(part.sender == me)
        self.sender = policy.sender(plan, mine_out) if len(mine_out) else None
        self.receiver = policy.receiver(plan) if len(part.landing) else None
        self.last: DeltaReport | None = None

    def refit(self, start: float, src: dict, dst: dict, version: int | None) -> RefitStats:
        """One refit, delta or keyframe as every process decides together (module docstring)."""
        ex = self.executor
        new = ex._version + 1 if version is None else int(version)
        prepared, device, problem = ex._prepare(src, dst)
        keyframe = self._decide(problem, device)
        marks = [("decide", time.perf_counter())]
        try:
            if not keyframe:
                return self._delta(start, marks, prepared, device, new)
            stats = ex._run(start, src, dst, new)
        except Exception:
            self._forget()
            raise
        self._committed(new, prepared, True)
        self.last = keyframe_report(ex.plan, self.sender.ops if self.sender else np.zeros(0, np.int64), new)
        return stats

    def _decide(self, problem: str | None, device: torch.device) -> bool:
        """Whether this refit is a keyframe, the same on every process; raises if a process refused its tensors."""
        ex = self.executor
        held = NONE if self.receiver is None else (-1 if self.receiver.held is None else self.receiver.held)
        base = NONE if self.sender is None else (-1 if self.sender.base is None else self.sender.base)
        due = int(self.sender is not None and self.sender.keyframe_due(self.policy))
        fp = ex._fingerprint ^ self.policy.keyframe_every
        t = [int(problem is not None), fp, -fp, -NONE if held == NONE else held, -held, -NONE if base == NONE
             else base, -base, due]
        bad, hi, lo, held_hi, held_lo, base_hi, base_lo, due = ex._vote(t, device, "delta preflight", before=True)
        refuse_disagreement(problem, bad, hi == -lo, "plan, binding and delta policy")
        versions = {held_hi, -held_lo, base_hi, -base_lo}
        return bool(due) or len(versions) != 1 or versions.pop() < 0

    def _delta(self, start: float, marks: list, prepared, device: torch.device, new: int) -> RefitStats:
        ex, plan = self.executor, self.executor.plan
        algorithm = ex.checksum
        payloads: dict[int, torch.Tensor] = {}
        sent_ops, encoded = [], []
        for peer, ops in self.sends.items():
            digest = source_digest(plan, ops, prepared.src_flat, algorithm) if algorithm else b""
            payloads[peer], d = self.sender.encode(ops, new, prepared.src_flat, digest=digest)
            sent_ops.append(ops)
            encoded.append(d)
        if self.sender is None:  # a receiver only: it sent nothing
            self.last = DeltaReport(new, self.receiver.held if self.receiver is not None else None)
        else:  # before the copy moves on: its base is the delta's
            self.last = self.sender.report(np.concatenate(sent_ops), encoded, new,
                                           sum(p.numel() for p in payloads.values()))
        marks.append(("encode", time.perf_counter()))
        arrived = self._deliver(payloads, device)
        marks.append(("exchange", time.perf_counter()))
        problem, decoded = None, []
        try:
            for peer, payload in arrived.items():
                d = self.receiver.read(payload, self.recvs[peer], f"group rank {peer}")
                if algorithm:
                    check_digest(self.receiver, d, self.recvs[peer], prepared.dst_flat, algorithm, f"group rank {peer}")
                decoded.append(d)
        except DeltaError as e:
            problem = str(e)
        except RuntimeError as e:  # e.g. CUDA out of memory expanding the indices: voted, so that the peers hear of
            problem = f"reading the deltas failed: {type(e).__name__}: {e}"  # it now rather than at their timeout
        ex._agree(device, problem)
        marks.append(("verify", time.perf_counter()))
        for d in decoded:
            self.receiver.apply(d, prepared.dst_flat)
        self._committed(new, prepared, False)
        marks.append(("apply", time.perf_counter()))
        ex._version = new
        seconds, phases = phase_times(start, marks)
        me = ex.rank
        return RefitStats(
            executor=ex.name, process=me, version=new, seconds=seconds, phases=phases,
            ops=sum(len(d.delta) for d in decoded), copies=sum(len(d.delta) for d in decoded),
            bytes_sent={p: t.numel() for p, t in payloads.items() if p != me},
            bytes_received={p: t.numel() for p, t in arrived.items() if p != me},
            local_bytes=payloads[me].numel() if me in payloads else 0,
            staging_bytes=sum(t.numel() for p, t in arrived.items() if p != me),
            transfers=sum(p != me for p in payloads) + sum(p != me for p in arrived), checksum=algorithm or "")

    def _deliver(self, payloads: dict[int, torch.Tensor], device: torch.device) -> dict[int, torch.Tensor]:
        """Every payload to its process (sizes first, then the bytes); the payloads that arrived, by sender."""
        ex, me = self.executor, self.executor.rank
        arrived = {me: payloads[me]} if me in payloads else {}
        if ex.size == 1:
            return arrived
        sizes_out = {p: torch.tensor([t.numel()], dtype=torch.int64, device=device)
                     for p, t in payloads.items() if p != me}
        sizes_in = {p: torch.zeros(1, dtype=torch.int64, device=device) for p in self.recvs if p != me}
        ex._exchange([(t, p, SIZE_TAG) for p, t in sizes_out.items()],
                     [(t, p, SIZE_TAG) for p, t in sizes_in.items()], "the delta sizes did not arrive")
        bufs = {}
        for p, t in sizes_in.items():
            n = int(t.item())
            if not 0 <= n <= 1 << 40:
                raise ExecutionError(f"group rank {p} announced a delta of {n} bytes; nothing was written")
            bufs[p] = torch.empty(n, dtype=torch.uint8, device=device)
        ex._exchange([(payloads[p], p, PAYLOAD_TAG) for p in sizes_out if payloads[p].numel()],
                     [(b, p, PAYLOAD_TAG) for p, b in bufs.items() if b.numel()], "the delta payloads did not arrive")
        arrived.update(bufs)
        return arrived

    def _committed(self, version: int, prepared, keyframe: bool) -> None:
        if self.sender is not None:
            self.sender.committed(version, prepared.src_flat, keyframe)
        if self.receiver is not None:
            self.receiver.held = version

    def _forget(self) -> None:
        if self.sender is not None:
            self.sender.forget()
        if self.receiver is not None:
            self.receiver.held = None


__all__ = ["CollectiveDelta"]
