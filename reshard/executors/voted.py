"""The refit of executors whose processes meet through a store and vote before they commit (NIXL, shared memory).

`refit` refuses a closed or earlier-failed executor, then `_transfer` (the executor's: land every byte, staged or
in place, by the deadline), votes and waits for every process (exchange.Exchange), `_commit`s and `_forget`s the
finished version's keys. A failure before the commit is published so the others stop waiting, leaves the executor
unusable, and is raised as one ExecutionError naming version, process, plan, reason and what the destination holds.
"""
from __future__ import annotations

import abc
import time

from ..errors import ExecutionError, ReshardError
from .base import Executor, RefitStats, phase_times


class VotedExecutor(Executor):
    """Base of the executors that vote on every refit through a store (module docstring). Subclasses set `label`,
    and in their constructor `process`, `plan`, `exchange`, `num_processes`, `staged`, `timeout` and `poll_max_s`,
    and call `_start_versions()`."""

    label = ""

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
