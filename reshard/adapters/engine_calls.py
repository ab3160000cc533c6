"""Engine calls on threads of their own, waited for by a deadline (a refit's steps share one), then left to their
thread: an engine that never answers cannot hold the trainer.
"""
from __future__ import annotations

import time
from typing import Any

from ..polling import Background


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
                try:
                    self.on_error(f"{self.label}: {e}")
                except Exception:  # noqa: BLE001 - the error itself is reported by wait_calls
                    pass
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


__all__ = ["EngineCall", "wait_calls"]
