"""How every process of one refit agrees (both integrations), through keys in the refit's part of the store
(adapters.rendezvous.scoped):

    fail       the first failure's reason; every wait checks it first, so a refusal anywhere stops every process
               at its next wait, not at its timeout.
    go/<i>     the group the trainers move i-th (verl; a trainer posting another fails the refit: their streams
               differ); the last trainer to post it decides gate i.
    gate/<i>   the i-th group k (open), or "closed" (a failing process closes every undecided gate, so no process
               enters a transfer a peer will never enter).
    done/<k>   a counter: the processes that finished moving group k.
    end        a counter: the trainers whose stream ended complete and valid (the end-of-stream verdict).
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Callable

from ..errors import ExecutionError
from ..polling import poll

MOST_S = 0.01  # the longest sleep between two looks at the store: what a failure adds to a waiting process's wait


class Agreement:
    """One process's view of one refit's agreement keys (see the module docstring).

    Args:
        keys: the refit's part of the store (a torch.distributed Store, e.g. a PrefixStore).
        processes: the processes of the refit (trainers and rollouts).
        trainers: the processes whose streams make the end-of-stream verdict.
        groups: the refit's tensor groups (the gates a failure closes).
        timeout: seconds any wait may last.
        who: this process, as failures name it ("trainer rank 1").
    """

    def __init__(self, keys: object, processes: int, trainers: int, groups: int, timeout: float, who: str) -> None:
        self.keys, self.processes, self.trainers, self.groups = keys, processes, trainers, groups
        self.timeout, self.who = timeout, who
        self.stop = threading.Event()  # set at a failure seen here and at close: every wait of this refit ends

    def fail(self, error: BaseException) -> BaseException:
        """Post why the refit fails (the first reason stays), close undecided gates and end this process's waits;
        returns `error`. Never raises."""
        with contextlib.suppress(Exception):  # best effort: then the refit is gone anyway
            self.keys.compare_set("fail", "", f"{self.who}: {type(error).__name__}: {error}".encode()[:4000])
            for i in range(self.groups):
                self.keys.compare_set(f"gate/{i}", "", "closed")
        self.stop.set()
        return error

    def failure(self) -> str | None:
        """The first failure's reason, or None while there is none (a store that went away is one)."""
        try:
            return self.keys.get("fail").decode(errors="replace") if self.keys.check(["fail"]) else None
        except Exception as e:  # noqa: BLE001 - the store's host (trainer 0) is gone
            return f"the refit's store went away ({type(e).__name__}: {e})"

    def check(self) -> None:
        """Raise ExecutionError if any process posted a failure or this refit was closed here."""
        reason = self.failure()
        if reason is not None:
            self.stop.set()
            raise ExecutionError(f"{self.who}: the refit failed: {reason}")
        self._stopped()

    def _stopped(self) -> None:
        if self.stop.is_set():
            raise ExecutionError(f"{self.who}: the refit was closed before it ended (a failure, the next refit, "
                                 f"or finalize)")

    def go(self, i: int, k: int) -> None:
        """This trainer has group k whole and checked as the i-th group it moves; the last trainer opens gate i.

        Raises:
            ExecutionError: another trainer moves another group i-th (posted as the refit's failure).
        """
        first = self.keys.compare_set(f"go/{i}", "", str(k))
        first = first.decode() if isinstance(first, bytes) else first
        if first != str(k):
            raise self.fail(ExecutionError(f"the trainers completed different groups as their group {i + 1} ({first} "
                                           f"and {k}): their streams differ (a tensor missing or out of place)"))
        if int(self.keys.add(f"go/{i}/count", 1)) == self.trainers:
            self.keys.compare_set(f"gate/{i}", "", str(k))

    def gate(self, i: int) -> int:
        """Block until gate i is decided; returns the group to move.

        Raises:
            ExecutionError: the gate closed (a process failed: its reason), the refit was closed here, or no
                decision within the timeout.
        """
        if not poll(lambda: self.keys.check([f"gate/{i}"]), time.monotonic() + self.timeout, first_s=1e-4,
                    most_s=MOST_S, between=self._stopped):  # a gate decided open is entered, failure or not
            raise ExecutionError(f"{self.who}: the trainers did not all complete their group {i + 1} of "
                                 f"{self.groups} within {self.timeout:.0f} s")
        value = self.keys.get(f"gate/{i}").decode()
        if value == "closed":
            self.check()
            raise ExecutionError(f"{self.who}: the refit failed")
        return int(value)

    def done(self, k: int) -> None:
        """This process finished moving group k."""
        self.keys.add(f"done/{k}", 1)

    def end(self) -> None:
        """This trainer's stream ended complete and valid, and every group it moved is done."""
        self.keys.add("end", 1)

    async def agreed(self, k: int) -> None:
        """Return once every process finished moving group k."""
        await self._until(lambda: int(self.keys.add(f"done/{k}", 0)) >= self.processes,
                          f"every process to finish group {k}")

    async def ended(self) -> None:
        """Return once every trainer's stream ended complete and valid (the end-of-stream verdict)."""
        await self._until(lambda: int(self.keys.add("end", 0)) >= self.trainers, "the trainers' end-of-stream verdict")

    def forget(self) -> None:
        """Delete the keys a finished refit leaves (fail, end) from a store that outlives it. Best effort."""
        for key in ("fail", "end"):
            with contextlib.suppress(Exception):  # a few bytes
                self.keys.delete_key(key)

    async def _until(self, done: Callable[[], bool], what: str) -> None:
        """Wait on the event loop (which stays free) until `done()`; a failure wins over `done`."""
        deadline, pause = time.monotonic() + self.timeout, 1e-4
        while True:
            self.check()
            if done():
                return
            if time.monotonic() > deadline:
                raise ExecutionError(f"{self.who}: waited {self.timeout:.0f} s for {what}")
            await asyncio.sleep(pause)
            pause = min(2 * pause, MOST_S)


__all__ = ["Agreement"]
