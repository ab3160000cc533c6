"""What the trainer session drives: an engine client, the capabilities some engines add, and calls into them.

`EngineClient` is vLLM's weight-sync client protocol (four methods). The optional capabilities are protocols of
their own, checked with `isinstance`: `Pausable`, `ReportsInFlight`, `ReportsStaged`, `Leased`.
`EngineCall` runs a call on a thread of its own, waited for by a deadline (`wait_calls`; a refit's steps share
one), then left to its thread: an engine that never answers cannot hold the trainer.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Protocol, runtime_checkable

from ..errors import ExecutionError
from ..polling import Background


@runtime_checkable
class EngineClient(Protocol):
    """An engine a `TrainerSession` refits: init once, then start / update (transfer, install) / finish per refit."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Bind the engine to a refit (`init_info`: a RefitSpec as JSON); raises if the engine refuses it."""

    def start_weight_update(self) -> None:
        """Open an update (before any byte of it lands)."""

    def update_weights(self, update_info: Any) -> None:
        """One phase of the open update: {"version", "refit", "phase": "transfer" | "install" | "all"}."""

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Close the open update: serve its weights as `weight_version`, or (None) end a failed one."""


@runtime_checkable
class Pausable(Protocol):
    """An engine that stops generating during a refit (`mode`: a VllmServer's /pause mode)."""

    def pause(self, mode: str = "wait") -> None:
        """Stop generating ("wait": requests in flight finish, "abort": aborted, "keep": frozen)."""

    def resume(self) -> None:
        """Generate again."""


@runtime_checkable
class ReportsInFlight(Protocol):
    """An engine that tells which requests it holds (asked while paused)."""

    def in_flight(self) -> list[str] | None:
        """The ids of the requests the engine holds now, or None when it cannot tell."""


@runtime_checkable
class ReportsStaged(Protocol):
    """An engine that tells whether the open update's staged transfer has ended on every worker."""

    def staged(self) -> bool | None:
        """True once every worker's bytes are whole, False while they land, None when the engine cannot tell.

        Raises ExecutionError when a worker's staged transfer failed (its error named).
        """


def landing_ended(answers: list[dict[str, Any]]) -> bool:
    """Every worker's answer to `reshard_staged` as one: True when all ended (ExecutionError naming a failed one)."""
    errors = [f"worker {i}: {a['error']}" for i, a in enumerate(answers) if a.get("error")]
    if errors:
        raise ExecutionError("the staged transfer failed before the flip: " + "; ".join(errors))
    return all(a.get("done") for a in answers)


@runtime_checkable
class Leased(Protocol):
    """An engine that keeps a driver's lease: other holders' refit calls are refused, a lapsed update ended."""

    def acquire_lease(self, holder: str, ttl: float, timeout: float | None = None) -> None:
        """Take (or renew) the lease as `holder` for `ttl` seconds; the refit calls after it carry it."""

    def release_lease(self, timeout: float | None = None) -> None:
        """End the lease this client holds (the engine closes what it left open); nothing if none."""


class EngineCall(Background):
    """`engine.method(*args)` on a thread of its own, started at once (its answer in `value`).

    `on_error` is called with the error's text as soon as the call raised (to wake a refit blocked elsewhere).
    """

    def __init__(self, engine: Any, method: str, args: tuple, on_error: Any = None) -> None:
        self.label, self.on_error = f"{engine!r}.{method}", on_error
        super().__init__(self._call, getattr(engine, method), args, name=f"reshard-{method}")

    def _call(self, fn: Any, args: tuple) -> Any:
        try:
            return fn(*args)
        except Exception as e:
            if self.on_error is not None:
                with contextlib.suppress(Exception):  # the error itself is reported by wait_calls
                    self.on_error(f"{self.label}: {e}")
            raise


def wait_calls(calls: list[EngineCall], timeout: float, deadline: float | None = None) -> list[str]:
    """Join every call by one deadline (`deadline`, else `timeout` s from now); the errors, and the calls late."""
    if deadline is None:
        deadline, late = time.monotonic() + timeout, f"no answer within {timeout:.0f} s"
    else:
        late = f"no answer by the refit's deadline ({timeout:.0f} s after it began)"
    errors = []
    for c in calls:
        if not c.join(deadline):
            errors.append(f"{c.label}: {late}")
        elif c.error is not None:
            errors.append(f"{c.label}: {c.error}")
    return errors


__all__ = ["EngineCall", "EngineClient", "Leased", "Pausable", "ReportsInFlight", "ReportsStaged", "landing_ended",
           "wait_calls"]
