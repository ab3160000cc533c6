"""Checks of public arguments: each refuses with ArgumentError (field, value, rule) before anything is built.
Nothing is coerced."""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from .errors import ArgumentError


def seconds(field: str, value: Any) -> float:
    """A number of seconds in (0, 86400] (an int or float, finite; not a bool or a string)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 < value <= 86400:
        raise ArgumentError(field, value, "must be a number of seconds in (0, 86400]")
    return float(value)


def integer(field: str, value: Any, low: int, high: int) -> int:
    """An int in [low, high] (not a bool, a float or a string)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ArgumentError(field, value, f"must be an integer in [{low}, {high}]")
    return value


def text(field: str, value: Any, none: bool = False, choices: tuple[str, ...] | None = None) -> str | None:
    """A non-empty string (one of `choices` where given), or None where allowed."""
    if value is None and none:
        return None
    if not isinstance(value, str) or not value or (choices is not None and value not in choices):
        rule = f"must be one of {choices}" if choices else "must be a non-empty string"
        raise ArgumentError(field, value, rule + (", or None" if none else ""))
    return value


def instance(field: str, value: Any, kind: type | tuple[type, ...], what: str, none: bool = False) -> Any:
    """An instance of `kind` (`what` names it in the error), or None where allowed."""
    if (value is None and none) or isinstance(value, kind):
        return value
    raise ArgumentError(field, value, f"must be {what}" + (", or None" if none else ""))


def _collection(field: str, value: Any, none: bool, kinds: tuple[type, ...], ok: Any, what: str) -> None:
    if value is None and none:
        return
    if not isinstance(value, kinds) or not all(ok(v) for v in value):
        raise ArgumentError(field, value, f"must be a list of {what}" + (", or None" if none else ""))


def integers(field: str, value: Any, none: bool = True) -> None:
    """None (where allowed), or a list, tuple, set or range of integers (not bools, not a string)."""
    _collection(field, value, none, (list, tuple, set, frozenset, range),
                lambda v: isinstance(v, int) and not isinstance(v, bool), "integers")


def names(field: str, value: Any, none: bool = True) -> None:
    """None (where allowed), or a list, tuple or set of strings (a single string is not a list of names)."""
    _collection(field, value, none, (list, tuple, set, frozenset), lambda v: isinstance(v, str), "names")


def number(field: str, value: Any) -> float:
    """A finite real number (an int or a float; not a bool, a string or a tensor)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ArgumentError(field, value, "must be a finite number")
    return value


def ranks(field: str, value: Any, count: int, none: bool = True) -> list[int] | None:
    """None (where allowed: every rank), or distinct integers in [0, count)."""
    if value is None and none:
        return None
    integers(field, value, none=False)
    bad = [r for r in value if not 0 <= r < count]
    if bad or len(set(value)) != len(list(value)):
        raise ArgumentError(field, value, f"must list distinct ranks in [0, {count})")
    return list(value)


def device(field: str, value: Any) -> Any:
    """A torch device this process has: "cpu", "meta", or an accelerator index that exists."""
    import torch

    if not isinstance(value, (str, torch.device)):
        raise ArgumentError(field, value, "must be a device name (e.g. 'cpu', 'cuda:0') or a torch.device")
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise ArgumentError(field, value, "is not a torch device name") from None
    if dev.type in ("cpu", "meta"):
        return dev
    backend = getattr(torch, dev.type, None)
    available = getattr(backend, "is_available", lambda: False)()
    if not available or (dev.index is not None and dev.index >= backend.device_count()):
        raise ArgumentError(field, value, "is not a device of this process")
    return dev


PLAN_SUFFIXES = (".npz", ".json")  # Plan.save's writers
PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg", ".eps", ".ps", ".tif", ".tiff", ".webp")  # matplotlib's


def output_path(field: str, path: Any, suffixes: tuple[str, ...] = ()) -> Path:
    """A file path that can be written (its directory exists and is writable, it is not a directory, its suffix is
    one of `suffixes` where given), checked before any work is done: the rule of the API and the CLI."""
    if not isinstance(path, (str, os.PathLike)) or isinstance(path, bytes) or not str(path):
        raise ArgumentError(field, path, "must be a file path (a non-empty str or pathlib.Path)")
    target = Path(path)
    try:
        if target.is_dir():
            raise ArgumentError(field, str(path), "is a directory, not a file path")
        parent = target.parent if str(target.parent) else Path(".")
        if not parent.is_dir():
            raise ArgumentError(field, str(path), f"cannot be written: the directory {str(parent)!r} does not exist")
        if not os.access(parent, os.W_OK):
            raise ArgumentError(field, str(path), f"cannot be written: no permission in {str(parent)!r}")
        if target.exists() and not target.is_file():
            raise ArgumentError(field, str(path), "exists and is not a regular file")
    except OSError as e:  # a name too long, a loop of links ...
        raise ArgumentError(field, str(path)[:200], f"cannot be written ({e.strerror or e})") from None
    if suffixes and target.suffix.lower() not in suffixes:
        raise ArgumentError(field, str(path), f"must end in one of {list(suffixes)} (the formats written)")
    return target


def rank_tensors(field: str, value: Any, none: bool = False, deep: bool = False) -> None:
    """A mapping of integer ranks (`deep`: to {name: torch tensor}; else the executors check what ranks hold)."""
    import torch
    from collections.abc import Mapping

    if value is None and none:
        return
    rule = "must map integer ranks to {name: torch.Tensor}" + (", or be None" if none else "")
    if not isinstance(value, Mapping):
        raise ArgumentError(field, value, rule)
    for rank, tensors in value.items():
        if isinstance(rank, bool) or not isinstance(rank, int) or deep and (not isinstance(tensors, Mapping) or not all(
                isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in tensors.items())):
            raise ArgumentError(field, value, rule)


__all__ = ["PLAN_SUFFIXES", "PLOT_SUFFIXES", "device", "instance", "integer", "integers", "names", "number",
           "output_path", "rank_tensors", "ranks", "seconds", "text"]
