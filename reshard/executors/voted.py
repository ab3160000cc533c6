"""The refit of executors whose processes meet through a store (executors.exchange) and vote before they commit
(NIXL, shared memory).

`refit` refuses a closed or earlier-failed executor, then `_transfer`s (a delta refit where `_delta`, an
executors.delta.VotedDelta, is set and the refit is no keyframe; else the transport's `_move`: land every byte,
staged or in place) by the deadline, votes and waits for every process (exchange.Exchange), `_commit`s (the
`_commit_program`, `_shifts`, then a GPU sync) and `_forget`s the finished version's keys. A failure before the
commit is published so the others stop waiting, leaves the executor unusable, and is raised as one ExecutionError
naming version, process, plan, reason and what the destination holds.
"""
from __future__ import annotations

import abc
import time
from typing import Any

import torch

from ..errors import ExecutionError, ReshardError
from .base import Executor, RefitStats, phase_times
from .checksum import algorithm
from .partition import Prepared
from .preflight import check_ops
from .reference import apply_shifts


class VotedExecutor(Executor):
    """Base of the executors that vote on every refit through a store (module docstring). Subclasses set `label`,
    call `_open` first in their constructor, then set `exchange`, `num_processes`, `staged` and `part`; they add
    their wire: `_move` (a dense refit's bytes), `_keys` and `_dense_stats`."""

    label = ""
    _dirty = True  # copies may be in flight on the GPU (the caller's, at first)

    def _open(self, plan: Any, binding: Any, process: int, src: Any, dst: Any, timeout: float, poll_max_s: float,
              checksum: "bool | str") -> None:
        """What every voted transport does first: the binding and the plan's ops checked, this process's tensors
        prepared (exactly the ranks the binding has it play: executors.partition), no version committed yet."""
        if timeout <= 0:
            raise ExecutionError(f"timeout={timeout} must be positive (seconds)")
        binding.check(plan.src.num_ranks, plan.dst.num_ranks)
        check_ops(plan)  # before a schedule indexes anything with the plan's ops
        self.plan, self.binding, self.process, self.itemsize = plan, binding, process, plan.itemsize
        self.timeout, self.poll_max_s, self.checksum = timeout, poll_max_s, algorithm(checksum)  # None when off
        self.prepared = Prepared(plan, src, dst, binding, process)
        self.device = self.prepared.device or torch.device("cpu")
        self.src_flat, self.dst_flat = self.prepared.src_flat, self.prepared.dst_flat
        self._version, self._broken, self._closed = 0, None, False

    @property
    def version(self) -> int:
        """The last version this executor committed (0 before the first refit)."""
        return self._version

    def refit(self, version: int | None = None) -> RefitStats:
        """Move this process's part of one refit; every process of the binding calls it with the same version."""
        if self._closed:
            raise ExecutionError(f"this {self.label} executor is closed")
        if self._broken is not None:
            raise ExecutionError(f"this {self.label} executor failed earlier ({self._broken}); close it and build "
                                 f"a new one with a new namespace")
        v = self._version + 1 if version is None else int(version)
        if v <= self._version:
            raise ExecutionError(f"refit version {v} is not above the last one ({self._version}); versions only grow")
        start = time.perf_counter()
        deadline = time.monotonic() + self.timeout
        marks = []
        try:
            self._transfer(v, deadline)
            marks.append(("transfer", time.perf_counter()))
            self.exchange.vote(v)
            self.exchange.wait_all(v, self.num_processes, deadline, self.poll_max_s)
            marks.append(("agree", time.perf_counter()))
        except Exception as e:  # noqa: BLE001 - a store, transport or copy error: named, the original the cause
            reason = self._reason(e, v)
            self._broken = f"refit version {v}: {reason}"
            self.exchange.fail(v, f"process {self.process}: {reason}")
            self._abandon()
            state = ("destination tensors were left unchanged (staged refit)" if self.staged else
                     "destination tensors may be partly written (in place)")
            raise ExecutionError(f"refit version {v} failed on process {self.process} (plan "
                                 f"{self.plan.digest[:12]}): {reason}; {state}") from e
        self._commit()
        marks.append(("commit", time.perf_counter()))
        self.exchange.forget(self._version, self._keys(self._version)
                             + (self._delta.keys(self._version) if self._delta is not None else ()))
        self._version = v
        return self._stats(v, *phase_times(start, marks))

    def _reason(self, e: Exception, v: int) -> str:
        """What failed, in words; a peer's earlier failure first (its cause, then the symptom here)."""
        reason = str(e) if isinstance(e, ReshardError) else f"{type(e).__name__}: {e}"
        try:
            first = self.exchange.failure(v)
        except Exception:  # noqa: BLE001 - the store may be what failed: keep this error as it is
            first = None
        if first is not None and "failed first" not in reason:
            reason = f"another process failed first ({first}); here: {reason}"
        return reason

    def _transfer(self, v: int, deadline: float) -> None:
        """Land this process's bytes of refit `v` (staged: in staging memory), by `deadline` (monotonic)."""
        if self._delta is not None and not self._delta.keyframe(v, deadline):
            self._delta.transfer(v, deadline)
        else:
            self._move(v, deadline)

    @abc.abstractmethod
    def _move(self, v: int, deadline: float) -> None:
        """Land this process's bytes of dense refit `v` by `deadline`."""

    def _run(self, program: Any, sync: bool = False) -> None:
        """Run a copy program (executors.copies); `sync`: then wait for the GPU (a peer may read what it wrote)."""
        if len(program):
            with torch.no_grad():
                program.run()
            self._dirty = True
        if sync:
            self._sync()

    def _sync(self) -> None:
        """Wait for this process's copies on the GPU before a peer may read what they wrote."""
        if self.device.type == "cuda" and self._dirty:
            torch.cuda.synchronize(self.device)
        self._dirty = False

    def _commit(self) -> None:
        """Every process voted: copy staged bytes into the destination tensors, apply value shifts, synchronize."""
        if self._delta is not None and self._delta.commit():
            return
        self._run(self._commit_program)
        apply_shifts(self._shifts)
        self._dirty = self._dirty or bool(self._shifts)
        self._sync()

    @abc.abstractmethod
    def _keys(self, previous: int) -> tuple[str, ...]:
        """Refit `previous`'s store keys of the transport's own, dropped once every process is past it."""

    def _abandon(self) -> None:
        """The refit failed: release what must not be reused (transfers in flight); keep memory a peer may write."""

    def _stats(self, v: int, seconds: float, phases: dict[str, float]) -> RefitStats:
        """This process's stats of the refit just committed."""
        if self._delta is not None and not self._delta.last.keyframe:
            return self._delta.stats(v, seconds, phases, self.staged)
        part = self.part
        return self._dense_stats(executor=self.name, process=self.process, version=v, seconds=seconds, phases=phases,
                                 staged=self.staged, ops=len(part.landing), bytes_sent=dict(part.bytes_sent),
                                 bytes_received=dict(part.bytes_received),
                                 local_bytes=part.local_numel * self.itemsize, checksum=self.checksum or "")

    @abc.abstractmethod
    def _dense_stats(self, **common: Any) -> RefitStats:
        """The RefitStats of a dense refit: `common` (what every transport counts alike) and the transport's own."""


__all__ = ["VotedExecutor"]
