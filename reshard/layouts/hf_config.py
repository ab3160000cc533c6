"""An HF config read as untrusted JSON: each key a family reads has a type and a range, checked strictly.

Integers must be JSON integers, booleans booleans; only an absent key takes the default (`null_is_default` opts
in where HF writes null for "not set"). Refusals are ModelConfigErrors naming key, value and rule; sizes past
`limits` are LimitErrors."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from ..errors import ModelConfigError
from ..limits import MAX_CONFIG_BYTES, MAX_DIM, MAX_LAYERS, check_limit
from ..untrusted import read_json

REQUIRED: Any = object()


def _config_error(field: str, value: Any, rule: str) -> ModelConfigError:
    return ModelConfigError(field=field, value=value, rule=rule)


def read_hf_config(config: "dict[str, Any] | str | os.PathLike") -> dict[str, Any]:
    """Read an HF config as untrusted input: a regular file of bounded size, strict JSON, an object at the top.

    Args:
        config: a dict (returned as it is), a config.json path, or a checkpoint directory.

    Returns:
        The config's JSON object.

    Raises:
        ModelConfigError: a path that cannot be read, a file too large, not JSON, or not an object.
    """
    if isinstance(config, dict):
        if not all(isinstance(k, str) for k in config):
            raise _config_error("config", config, "must have string keys (a JSON object)")
        return config
    if not isinstance(config, (str, os.PathLike)):
        raise _config_error("config", config, "must be a dict, a config.json path or a checkpoint directory")
    path = Path(config)
    try:
        is_dir = path.is_dir()
    except OSError as e:  # a name too long, a loop of links ...: not a path to read
        raise _config_error("config", str(config)[:200], f"cannot be read as a path ({e.strerror})") from None
    if is_dir:
        path = path / "config.json"
        if not path.exists():
            raise _config_error("config", str(config), "is a directory without a config.json")
    value = read_json(path, MAX_CONFIG_BYTES, _config_error, "config")
    if not isinstance(value, dict):
        raise _config_error("config", str(path), f"must hold a JSON object, not a {type(value).__name__}")
    return value


def _present(config: dict[str, Any], key: str, default: Any, null_is_default: bool, kind: type,
             what: str) -> tuple[bool, Any]:
    """(True, the value) where `key` is set, a JSON `what` (Python `kind`, a bool never an int); else (False,
    `default`), a missing REQUIRED key refused."""
    if key not in config or (null_is_default and config[key] is None):
        if default is REQUIRED:
            raise ModelConfigError(field=key, rule="is required and missing" if key not in config else
                                   "is required and must not be null")
        return False, default
    value = config[key]
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise _config_error(key, value, f"must be a JSON {what}, not {type(value).__name__}")
    return True, value


def get_int(config: dict[str, Any], key: str, default: Any = REQUIRED, *, minimum: int = 1,
            maximum: int = MAX_DIM, null_is_default: bool = False, what: str = "a dimension") -> Any:
    """An integer in [minimum, maximum] (default when absent; None may be the default)."""
    present, value = _present(config, key, default, null_is_default, int, "integer")
    if not present:
        return value
    if value < minimum:
        raise _config_error(key, value, f"must be at least {minimum}")
    check_limit(key, value, maximum, what, "model config")
    return value


def get_bool(config: dict[str, Any], key: str, default: Any = REQUIRED, null_is_default: bool = False) -> Any:
    """A boolean (default when absent)."""
    return _present(config, key, default, null_is_default, bool, "boolean (true or false)")[1]


def get_str(config: dict[str, Any], key: str, default: Any = REQUIRED, choices: Sequence[str] | None = None,
            null_is_default: bool = False) -> Any:
    """A string, one of `choices` when given (default when absent)."""
    present, value = _present(config, key, default, null_is_default, str, "string")
    if present and choices is not None and value not in choices:
        raise _config_error(key, value, f"must be one of {list(choices)}")
    return value


def get_int_list(config: dict[str, Any], key: str, *, below: int, default: Any = (),
                 null_is_default: bool = True) -> tuple[int, ...]:
    """A list of integers in [0, below) (layer numbers), without repeats."""
    present, value = _present(config, key, default, null_is_default, list, "list of layer numbers")
    if not present:
        return tuple(value)
    check_limit(key + " (entries)", len(value), MAX_LAYERS, "layers", "model config")
    bad = [x for x in value if not isinstance(x, int) or isinstance(x, bool)]
    if bad:
        raise _config_error(key, value, f"must list JSON integers; {bad[0]!r} is a {type(bad[0]).__name__}")
    outside = sorted({x for x in value if not 0 <= x < below})
    if outside:
        raise _config_error(key, value, f"lists layers {outside[:5]} outside [0, {below})")
    if len(set(value)) != len(value):
        raise _config_error(key, value, "lists a layer twice")
    return tuple(value)


def get_str_list(config: dict[str, Any], key: str, length: int, choices: Sequence[str]) -> tuple[str, ...]:
    """A list of `length` strings, each one of `choices` (the key must be present)."""
    value = config[key]
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise _config_error(key, value, "must be a JSON list of strings")
    bad = sorted({x for x in value if x not in choices})
    if len(value) != length or bad:
        raise _config_error(key, value, f"must list {length} entries of {list(choices)}; got {len(value)}"
                           + (f" with {bad}" if bad else ""))
    return tuple(value)


__all__ = ["REQUIRED", "get_bool", "get_int", "get_int_list", "get_str", "get_str_list", "read_hf_config"]
