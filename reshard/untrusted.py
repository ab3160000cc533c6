"""Reading files and JSON from outside (HF configs, saved plans): bounded, strict, never blocking. A path must be a
regular file within the caller's limit; JSON must be UTF-8, without repeated keys, NaN / Infinity or nesting deeper
than `limits.MAX_JSON_DEPTH`. Every refusal is the caller's error class, naming the path and the rule.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, Callable

from .errors import ReshardError
from .limits import MAX_JSON_DEPTH, json_depth

ErrorFactory = Callable[[str, Any, str], ReshardError]  # (field, value, rule) -> the error to raise


def read_bytes(path: "str | os.PathLike[str]", limit: int, error: ErrorFactory, field: str = "path") -> bytes:
    """The bytes of a regular file of at most `limit` bytes; opened non-blocking, checked before reading."""
    shown = os.fspath(path)
    try:
        fd = os.open(shown, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise error(field, shown, "does not exist") from None
    except OSError as e:
        raise error(field, shown, f"cannot be opened ({e.strerror or e})") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise error(field, shown, "is a directory, not a file")
        if not stat.S_ISREG(info.st_mode):
            raise error(field, shown, "is not a regular file (a FIFO, socket or device is refused)")
        if info.st_size > limit:
            raise error(field, shown, f"is {info.st_size:,} bytes; the limit is {limit:,}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise error(field, shown, f"grew past the limit of {limit:,} bytes while being read")
        return data
    except OSError as e:
        raise error(field, shown, f"cannot be read ({e.strerror or e})") from None
    finally:
        os.close(fd)


class _Refused(Exception):
    """A rule the JSON text breaks (raised from json's hooks)."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Refused(f"repeats the key {k!r} in one JSON object")
        out[k] = v
    return out


def _constant(name: str) -> Any:
    raise _Refused(f"uses {name}, which JSON does not have")


def parse_json(data: "bytes | str", error: ErrorFactory, field: str, value: Any = "<text>") -> Any:
    """A JSON value from `data` (UTF-8 bytes or text) by the module docstring's rules; errors name `field` and
    `value` (where the data came from)."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        out = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_constant)
    except UnicodeDecodeError as e:  # (a ValueError: before JSON's own)
        raise error(field, value, f"is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except _Refused as e:
        raise error(field, value, str(e)) from None
    except RecursionError:
        raise error(field, value, f"nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:  # JSONDecodeError
        raise error(field, value, f"is not valid JSON ({e})") from None
    if json_depth(out) > MAX_JSON_DEPTH:
        raise error(field, value, f"nests deeper than {MAX_JSON_DEPTH} levels")
    return out


def read_json(path: "str | Path", limit: int, error: ErrorFactory, field: str = "path") -> Any:
    """The JSON value of the file at `path`: `read_bytes` (at most `limit` bytes), then `parse_json`."""
    return parse_json(read_bytes(path, limit, error, field), error, field, os.fspath(path))


__all__ = ["parse_json", "read_bytes", "read_json"]
