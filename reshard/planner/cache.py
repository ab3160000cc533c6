"""Plans compiled once per (source layout, destination layout, options) in a process, then reused.

Both sides of a cross-process refit compile the same plan from the same layouts; an engine initialized again, or
a trainer that refits every step, finds it here. Layouts are frozen values, so they are the key. `stats()` counts
compiles and hits.
"""
from __future__ import annotations

import functools
from typing import Any

from ..layouts import Layout
from ..layouts.model import frozen
from .compiler import compile_plan
from .plan import Plan

CAPACITY = 32
_cleared = {"compiles": 0, "hits": 0}  # counted before the last clear()


@functools.lru_cache(maxsize=CAPACITY)
def _compile(src: Layout, dst: Layout, options: tuple) -> Plan:
    return compile_plan(src, dst, **dict(options))


def cached_plan(src: Layout, dst: Layout, **options: Any) -> Plan:
    """`compile_plan(src, dst, **options)`, compiled once per distinct arguments in this process."""
    return _compile(src, dst, frozen(options))


def stats() -> dict[str, int]:
    """Compiles and hits so far in this process (and plans held)."""
    info = _compile.cache_info()
    return {"compiles": _cleared["compiles"] + info.misses, "hits": _cleared["hits"] + info.hits,
            "held": info.currsize}


def clear() -> None:
    """Forget every cached plan (the counts stay)."""
    info = _compile.cache_info()
    _cleared["compiles"] += info.misses
    _cleared["hits"] += info.hits
    _compile.cache_clear()


__all__ = ["cached_plan", "clear", "stats"]
