"""A thread's own time: the wall time of a span less the time the thread was ready to run but waited for a CPU.

Tests that bound how long a survivor takes to fail ("the timeout plus a slack") must measure what the library
decides (how long it waits, and what it does after), not how busy the machine is: on a loaded 2-core machine a
runnable thread can wait seconds for a CPU, and a wall-clock bound then fails with no bug. Linux counts that wait
per thread (`/proc/thread-self/schedstat`, second field: run-queue delay in ns); `OwnClock` subtracts the measuring
thread's (the one that waits and raises; other threads' queueing overlaps it and would be counted twice). An untimed
wait, or a second timeout in a row, is sleeping, not queueing, so it still shows in full. Where schedstat is not
readable the clock is the wall clock.
"""
from __future__ import annotations

import importlib
import time
from functools import partial
from typing import Any, Callable


def run_delay() -> float:
    """Seconds the calling thread has spent ready to run but not running (0.0 where not readable)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


class OwnClock:
    """Started at construction, read on the same thread: `seconds()` is the span's wall time less the thread's
    run-queue delay (never less than 0); `wall()` the plain wall time."""

    def __init__(self) -> None:
        self.start, self.delay = time.monotonic(), run_delay()

    def wall(self) -> float:
        """Wall seconds since the start."""
        return time.monotonic() - self.start

    def seconds(self) -> float:
        """Own seconds since the start: wall time less the time spent queueing for a CPU."""
        wall = self.wall()
        return min(wall, max(0.0, wall - max(0.0, run_delay() - self.delay)))


class _OwnTime:
    """The `time` module, but `monotonic()` reads the calling thread's own time (less its run-queue delay)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    @staticmethod
    def monotonic() -> float:
        return time.monotonic() - run_delay()


def on_own_clock(module: str, name: str) -> Callable[..., None]:
    """`module.name` as a picklable target for spawned workers that runs it with that module's `time.monotonic()`
    reading the calling thread's own time: a worker that times a span with two `time.monotonic()` calls on one
    thread then reports own seconds (as `OwnClock`), without a change of its own."""
    return partial(_run_on_own_clock, module, name)


def _run_on_own_clock(module: str, name: str, *args: Any) -> None:
    mod = importlib.import_module(module)
    mod.time = _OwnTime()
    getattr(mod, name)(*args)
