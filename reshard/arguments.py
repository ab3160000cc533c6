"""Checks of public arguments: each refuses with ArgumentError (field, value, rule) before anything
is built, so a wrong type never surfaces as a TypeError or AttributeError from inside. Nothing is coerced."""
from __future__ import annotations

import math
from typing import Any

from .errors import ArgumentError


def seconds(field: str, value: Any, low: float = 0.0, high: float = 86400.0, none: bool = False) -> float | None:
    """A number of seconds in (low, high] (an int or float, finite; not a bool or a string)."""
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low < value <= high:
        raise ArgumentError(field, value, f"must be a number of seconds in ({low:g}, {high:g}]"
                                          + (", or None" if none else ""))
    return float(value)


def integer(field: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ArgumentError(field, value, f"must be an integer in [{low}, {high}]")
    return value


def text(field: str, value: Any, none: bool = False, choices: tuple[str, ...] | None = None) -> str | None:
    if value is None and none:
        return None
    if not isinstance(value, str) or not value or (choices is not None and value not in choices):
        rule = f"must be one of {choices}" if choices else "must be a non-empty string"
        raise ArgumentError(field, value, rule + (", or None" if none else ""))
    return value


def instance(field: str, value: Any, kind: type | tuple[type, ...], what: str, none: bool = False) -> Any:
    if (value is None and none) or isinstance(value, kind):
        return value
    raise ArgumentError(field, value, f"must be {what}" + (", or None" if none else ""))


def integers(field: str, value: Any, none: bool = True) -> None:
    """None (where allowed), or a list, tuple, set or range of integers (not bools, not a string)."""
    if value is None and none:
        return
    if not isinstance(value, (list, tuple, set, frozenset, range)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ArgumentError(field, value, "must be a list of integers" + (", or None" if none else ""))


def names(field: str, value: Any, none: bool = True) -> None:
    """None (where allowed), or a list, tuple or set of strings (a single string is not a list of names)."""
    if value is None and none:
        return
    if not isinstance(value, (list, tuple, set, frozenset)) or not all(isinstance(v, str) for v in value):
        raise ArgumentError(field, value, "must be a list of names" + (", or None" if none else ""))


__all__ = ["instance", "integer", "integers", "names", "seconds", "text"]
