"""Waiting on a condition that another process makes true (a key in a store, a counter reaching a count): poll
it with a sleep that doubles between calls, so a short wait costs microseconds and a long one little CPU.
Standard library only."""
from __future__ import annotations

import time
from typing import Callable


def poll(done: Callable[[], bool], deadline: float, *, first_s: float = 2e-5, most_s: float = 0.05,
         between: Callable[[], None] | None = None) -> bool:
    """Call `done` until it is true (True) or the time.monotonic() `deadline` passes (False), sleeping between
    calls from `first_s` doubling to `most_s`; `between` runs before each sleep (it raises to stop early)."""
    pause = first_s
    while not done():
        if between is not None:
            between()
        now = time.monotonic()
        if now >= deadline:
            return False
        time.sleep(min(pause, deadline - now))
        pause = min(2 * pause, max(most_s, first_s))
    return True


__all__ = ["poll"]
