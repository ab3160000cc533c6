"""The registry of model families: by name (`ModelSpec.family`) and by HF architecture / model_type.

At the bottom of the layouts: it imports nothing from them, so the spec can look a family up and the families
can register into it without a circle. A family registers itself when its class is defined (`family.py`);
the built-in ones are the modules of `families/`, imported by the package.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import ModelConfigError

_BY_KEY: dict[str, Any] = {}   # HF architecture or model_type -> family
_BY_NAME: dict[str, Any] = {}  # ModelSpec.family -> family


def register(family: Any) -> None:
    """Make `family` (a ModelFamily) findable by its name, architectures and model types; a later
    registration of the same name replaces the earlier one (a module imported again)."""
    for key in family.architectures + family.model_types:
        _BY_KEY[key] = family
    _BY_NAME[family.name] = family


def is_registered(name: str) -> bool:
    return name in _BY_NAME


def family(name: str) -> Any:
    """The family a ModelSpec names."""
    if name not in _BY_NAME:
        raise ModelConfigError(f"unknown model family {name!r}; registered: {', '.join(sorted(_BY_NAME))}")
    return _BY_NAME[name]


def families() -> list[Any]:
    return [_BY_NAME[n] for n in sorted(_BY_NAME)]


def registered_families() -> list[str]:
    return sorted(_BY_NAME)


def supported_architectures() -> list[str]:
    return sorted(k for k in _BY_KEY if k[:1].isupper())


def read_hf_config(config: "dict[str, Any] | str | Path") -> dict[str, Any]:
    """An HF config as a dict, from a dict, a config.json path, or a checkpoint directory."""
    if isinstance(config, dict):
        return config
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelConfigError(f"no HF config at {path}") from None
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path} is not valid JSON: {exc}") from None


def discover(config: "dict[str, Any] | str | Path") -> Any:
    """The family of an HF config, by `architectures` first, then `model_type`."""
    config = read_hf_config(config)
    for key in list(config.get("architectures") or ()) + [config.get("model_type", "")]:
        if key in _BY_KEY:
            return _BY_KEY[key]
    raise ModelConfigError(
        f"unknown architecture {config.get('architectures')} (model_type={config.get('model_type')!r}); "
        f"supported: {', '.join(supported_architectures())}")


def spec_from_hf_config(config: "dict[str, Any] | str | Path", include_mtp: bool = False) -> Any:
    """Build a ModelSpec from an HF config dict, a config.json path, or a checkpoint directory."""
    config = read_hf_config(config)
    return discover(config).spec(config, include_mtp=include_mtp)
