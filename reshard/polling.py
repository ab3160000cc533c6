"""Waiting with a deadline, the one place it is written: `poll` (a condition, with doubling sleeps),
`wait_events` (events such as CUDA's, in order) and `Background` (a call that may block on a peer, on a daemon
thread joined by a deadline). Standard library only."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable


def poll(done: Callable[[], bool], deadline: float, *, first_s: float = 2e-5, most_s: float = 0.05,
         between: "Callable[[], bool | None] | None" = None) -> bool:
    """Call `done` until it is true (True) or the time.monotonic() `deadline` passes (False), sleeping between
    calls from `first_s` doubling to `most_s`; `between` runs before each sleep: it raises to stop early, and
    returns True where `done` made progress (then `done` runs again at once and the sleeps start over)."""
    pause = first_s
    while not done():
        progressed = between() if between is not None else None
        now = time.monotonic()
        if now >= deadline:
            return False
        if progressed is True:
            pause = first_s
            continue
        time.sleep(min(pause, deadline - now))
        pause = min(2 * pause, max(most_s, first_s))
    return True


def wait_events(events: list, timeout: float, what: "list[str] | Callable[[int], str]") -> None:
    """Wait for events (anything with `query()`) in order; `what` names event i (a list, or a function).

    Raises:
        ExecutionError: `timeout` seconds passed without the next event completing.
    """
    from .errors import ExecutionError

    for i, ev in enumerate(events):
        if not poll(ev.query, time.monotonic() + timeout, first_s=1e-4, most_s=1e-4):
            name = what(i) if callable(what) else what[i]
            raise ExecutionError(f"no progress for {timeout:.1f} s waiting for {name}")


class Background:
    """`fn(*args)` on a daemon thread of its own, started at once; `join` waits for it by a deadline.

    Attributes:
        value: what the call returned (once it finished without an error).
        error: the exception it raised, if it did (handed to the caller: nothing is logged here).
    """

    def __init__(self, fn: Callable[..., Any], *args: Any, name: str) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn, args), daemon=True, name=name)
        self.thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple) -> None:
        try:
            self.value = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to whoever joins
            self.error = e

    def join(self, deadline: float) -> bool:
        """Wait until the call finished (True) or the time.monotonic() `deadline` passed (False: it goes on)."""
        self.thread.join(max(0.0, deadline - time.monotonic()))
        return not self.thread.is_alive()


__all__ = ["Background", "poll", "wait_events"]
