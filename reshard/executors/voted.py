"""The refit of executors whose processes meet through a store and vote before they commit: NIXL's and the
shared-memory executor. One place for what both do around the bytes they move:

  1. refuse a closed executor, or one that failed earlier (a peer may still write into its memory: build a new
     one with a new namespace); the version is the previous one + 1 unless given, and only grows;
  2. `_transfer(version, deadline)` (the executor's own): every byte of this process lands (staged: in staging
     memory, the destination untouched), every wait bounded by `timeout` from the start of the refit;
  3. the vote (exchange.Exchange): this process counts itself done and waits until every process of the binding
     is, or one reports a failure;
  4. `_commit()`: staged bytes are copied into the destination tensors (and value shifts applied); then
     `_forget(version)` drops the finished version's store keys.

Any failure before the commit becomes one ExecutionError that names the version, the process, the plan, the
reason (another process's first, when one failed before: the cause, then the symptom here) and what the
destination holds; the failure is written to the store so that the other processes stop waiting, and the
executor is unusable from then on.
"""
from __future__ import annotations

import abc
import time
from typing import Any

from ..errors import ExecutionError, ReshardError
from .base import Executor
from .stats import RefitStats, phase_times


class VotedExecutor(Executor):
    """Base of the executors that vote on every refit through a store (see the module docstring).

    Subclasses set `label` (for messages), and in their constructor `process`, `plan`, `exchange`,
    `num_processes`, `staged`, `timeout` and `poll_max_s`, and call `_start_versions()`.
    """

    label = ""
    process: int
    plan: Any
    exchange: Any
    num_processes: int
    staged: bool
    timeout: float
    poll_max_s: float

    def _start_versions(self) -> None:
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
        self._forget(self._version)
        self._version = v
        return self._stats(v, *phase_times(start, marks))

    def _reason(self, e: Exception, v: int) -> str:
        """What failed, in words; a peer's earlier failure first (its cause, then the symptom here)."""
        reason = str(e) if isinstance(e, ReshardError) else self._describe(e)
        try:
            first = self.exchange.failure(v)
        except Exception:  # noqa: BLE001 - the store may be what failed: keep this error as it is
            first = None
        if first is not None and "failed first" not in reason:
            reason = f"another process failed first ({first}); here: {reason}"
        return reason

    def _describe(self, e: Exception) -> str:
        """A transport's own error in words (NIXL's are long: executors.nixl.agent.describe)."""
        return f"{type(e).__name__}: {e}"

    @abc.abstractmethod
    def _transfer(self, version: int, deadline: float) -> None:
        """Land this process's bytes of refit `version` (staged: in staging memory), by `deadline` (monotonic)."""

    @abc.abstractmethod
    def _commit(self) -> None:
        """Every process voted: copy staged bytes into the destination tensors, apply value shifts, synchronize."""

    def _forget(self, previous: int) -> None:
        """The refit after version `previous` is committed everywhere: drop `previous`'s store keys."""

    def _abandon(self) -> None:
        """The refit failed: release what must not be reused (transfers in flight); keep memory a peer may write."""

    @abc.abstractmethod
    def _stats(self, version: int, seconds: float, phases: dict[str, float]) -> RefitStats:
        """This process's stats of the refit just committed."""


__all__ = ["VotedExecutor"]
