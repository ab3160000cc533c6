"""Plans compiled once per (source layout, destination layout, options) in a process, then reused.

Both sides of a cross-process refit compile the same plan from the same layouts; an engine initialized again, or
a trainer that refits every step, finds it here. Layouts are frozen values, so they are the key. `stats()` counts
compiles and hits.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from ..layouts import Layout
from .compiler import compile_plan
from .plan import Plan

CAPACITY = 32
_plans: "OrderedDict[tuple, Plan]" = OrderedDict()
_lock = threading.Lock()
_stats = {"compiles": 0, "hits": 0}


def _frozen(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    return value


def cached_plan(src: Layout, dst: Layout, **options: Any) -> Plan:
    """`compile_plan(src, dst, **options)`, compiled once per distinct arguments in this process."""
    key = (src, dst, _frozen(options))
    with _lock:
        plan = _plans.get(key)
        if plan is not None:
            _plans.move_to_end(key)
            _stats["hits"] += 1
            return plan
    plan = compile_plan(src, dst, **options)
    with _lock:
        _stats["compiles"] += 1
        _plans[key] = plan
        while len(_plans) > CAPACITY:
            _plans.popitem(last=False)
    return plan


def stats() -> dict[str, int]:
    """Compiles and hits so far in this process (and plans held)."""
    with _lock:
        return {**_stats, "held": len(_plans)}


def clear() -> None:
    """Forget every cached plan (the counts stay)."""
    with _lock:
        _plans.clear()


__all__ = ["cached_plan", "clear", "stats"]
