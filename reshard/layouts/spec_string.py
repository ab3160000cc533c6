"""Layouts as short strings (`megatron:tp=4,pp=2,ep=8`) and as JSON, for the CLI and for saved plans."""
from __future__ import annotations

import json
from typing import Any

from ..errors import LayoutError
from .base import Layout
from .hf import HfLayout
from .megatron import MegatronLayout
from .model import ModelSpec
from .vllm import VllmLayout

LAYOUT_KINDS: dict[str, type[Layout]] = {cls.kind: cls for cls in (MegatronLayout, VllmLayout, HfLayout)}

# Short aliases accepted in layout strings.
_ALIASES = {"ep": {"vllm": "expert_parallel"}, "first": {"megatron": "first_stage_layers"},
            "last": {"megatron": "last_stage_layers"}}


def _value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    try:
        return int(text)
    except ValueError:
        return text


def parse_layout(text: str, model: ModelSpec) -> Layout:
    """Parse 'kind:key=value,...' (e.g. 'vllm:tp=8,replicas=8'); errors name the bad part."""
    kind, _, rest = text.partition(":")
    kind = kind.strip().lower()
    if kind not in LAYOUT_KINDS:
        raise LayoutError(kind or text, f"unknown layout kind {kind!r}; expected one of {sorted(LAYOUT_KINDS)}")
    cls = LAYOUT_KINDS[kind]
    fields: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, val = item.partition("=")
        key = key.strip()
        if not eq:
            fields[_ALIASES.get(key, {}).get(kind, key)] = True  # bare flag, e.g. 'vllm:tp=2,ep'
            continue
        key = _ALIASES.get(key, {}).get(kind, key)
        if key not in cls.model_fields or key == "model":
            known = sorted(k for k in cls.model_fields if k != "model")
            raise LayoutError(kind, f"unknown option {key!r}; {kind} layouts take {known}")
        fields[key] = _value(val.strip())
    from pydantic import ValidationError

    try:
        return cls(model=model, **fields)
    except ValidationError as exc:
        # Surface our own error when a validator raised one; otherwise a readable field error.
        for err in exc.errors():
            if isinstance(err.get("ctx", {}).get("error"), LayoutError):
                raise err["ctx"]["error"] from None
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise LayoutError(kind, problems) from None


def layout_to_dict(layout: Layout) -> dict[str, Any]:
    return {"kind": layout.kind, **json.loads(layout.model_dump_json())}


def layout_from_dict(data: dict[str, Any]) -> Layout:
    data = dict(data)
    kind = data.pop("kind", None)
    if kind not in LAYOUT_KINDS:
        raise LayoutError(str(kind), f"unknown layout kind {kind!r}; expected one of {sorted(LAYOUT_KINDS)}")
    return LAYOUT_KINDS[kind].model_validate(data)
