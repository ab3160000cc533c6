"""Layouts as short strings (`megatron:tp=4,pp=2,ep=8`) and as JSON, for the CLI and for saved plans."""
from __future__ import annotations

import json
import re
import types
import typing
from typing import Any

from ..errors import ArgumentError, LayoutError, LimitError, show
from .base import Layout
from .model import ModelSpec
from .registry import layout_class

_ALIASES = {"ep": {"vllm": "expert_parallel"}, "first": {"megatron": "first_stage_layers"},  # short forms in strings
            "last": {"megatron": "last_stage_layers"}, "placement": {"vllm": "expert_placement"}}
# Fields a string cannot carry, with why (str(layout) names them by digest only)
_NOT_IN_STRINGS = {"vllm": {"expert_placement": "an expert placement other than vLLM's initial one is a map per MoE "
                                                "layer, carried by the layout's JSON form (layout_to_dict), not a "
                                                "layout string; redundant_experts=N gives the initial placement"}}
_INT = re.compile(r"[+-]?[0-9]{1,30}")  # ASCII digits only: int() also reads other scripts' digits
_WORD = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
_BOOLS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}
MAX_LAYOUT_TEXT = 4096


def _base_types(annotation: Any) -> set[Any]:
    """The plain types a field's annotation allows (Optional, Annotated and Literal unwrapped)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _base_types(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_base_types(a) for a in typing.get_args(annotation)))
    if origin is typing.Literal:
        return {str}
    return {annotation}


def _value(engine: str, key: str, text: str | None, annotation: Any) -> Any:
    """The value of one option (`text` None: given bare) by the field's type: an integer, a boolean (a bare flag:
    True) or a word; else LayoutError."""
    allowed = _base_types(annotation)
    if text is None and bool not in allowed:
        raise LayoutError(engine, f"option {key!r} needs a value ({key}=...); only flags may stand alone", {key: None})
    if text is None:
        return True
    if bool in allowed:
        if text.lower() not in _BOOLS:
            raise LayoutError(engine, f"{key}={text!r} must be true or false", {key: text})
        return _BOOLS[text.lower()]
    if int in allowed:
        if not _INT.fullmatch(text):
            raise LayoutError(engine, f"{key}={text!r} must be a whole number in ASCII digits", {key: text})
        return int(text)
    if not _WORD.fullmatch(text):
        raise LayoutError(engine, f"{key}={text!r} must be a word of letters, digits, '-' or '_'", {key: text})
    return text


def parse_layout(text: str, model: ModelSpec) -> Layout:
    """Parse a layout string such as 'vllm:tp=8,replicas=8' or 'megatron:tp=2,pp=2,ep=8,etp=1,world=16'.

    Args:
        text: 'engine:key=value,...', each option once, a bare option only for a flag (untrusted: checked).
        model: the model the layout places.

    Returns:
        The layout, validated.

    Raises:
        LayoutError: an unknown engine or option, a repeated option, a malformed value, or a layout that cannot
            exist (the message names the bad part).
        LimitError: a string or a size beyond `reshard.limits`.
    """
    if not isinstance(text, str):
        raise LayoutError("layout", f"a layout string must be a str, not {type(text).__name__}", {"layout": text})
    if not isinstance(model, ModelSpec):
        raise ArgumentError("model", model, "must be a ModelSpec")
    if len(text) > MAX_LAYOUT_TEXT:
        raise LimitError("layout", f"{text[:40]}...", MAX_LAYOUT_TEXT, "characters of a layout string")
    engine, _, rest = text.partition(":")
    engine = engine.strip().lower()
    if engine == "megatron-ckpt":  # derived from a checkpoint's files, which layouts never read
        raise LayoutError(engine, "a checkpoint's layout is derived from its metadata, not declared",
                          {"layout": text}, fix="use reshard.adapters.megatron.checkpoint_layout(open_checkpoint("
                          "path), spec), or `reshard plan --src megatron-ckpt:PATH`")
    cls = layout_class(engine)
    known = sorted(k for k in cls.model_fields if k != "model")
    fields: dict[str, Any] = {}
    for item in (s.strip() for s in rest.split(",")):
        if not item:
            if rest.strip():
                raise LayoutError(engine, f"empty option in {text!r} (two commas, or a trailing one)", {"layout": text})
            continue
        raw, eq, val = item.partition("=")
        key = _ALIASES.get(raw.strip(), {}).get(engine, raw.strip())
        if key in _NOT_IN_STRINGS.get(engine, {}):
            raise LayoutError(engine, f"option {raw.strip()!r}: {_NOT_IN_STRINGS[engine][key]}", {key: val})
        if key not in cls.model_fields or key == "model":
            raise LayoutError(engine, f"unknown option {raw.strip()!r}; {engine} layouts take {known}",
                              {raw.strip(): val})
        if key in fields:
            raise LayoutError(engine, f"option {raw.strip()!r} is given twice in {text!r}", {key: val})
        fields[key] = _value(engine, key, val.strip() if eq else None, cls.model_fields[key].annotation)
    return cls(model=model, **fields)


def layout_to_dict(layout: Layout) -> dict[str, Any]:
    """A layout as JSON data (`layout_from_dict` reads it back).

    Args:
        layout: any registered layout.

    Returns:
        {"engine": its engine, then its fields, the model's included}.

    Raises:
        LayoutError: `layout` is not a Layout.
    """
    if not isinstance(layout, Layout):
        raise LayoutError("layout", f"layout={show(layout)} must be a Layout", {"layout": layout})
    return {"engine": layout.engine, **json.loads(layout.model_dump_json())}


def layout_from_dict(data: dict[str, Any]) -> Layout:
    """The layout `layout_to_dict` wrote ("kind" is read as "engine": plan files written before the rename).

    Args:
        data: the JSON object.

    Returns:
        The layout, validated.

    Raises:
        LayoutError: not a JSON object, an engine no layout is registered for, or fields the layout refuses.
    """
    if not isinstance(data, dict):
        raise LayoutError("layout", f"a layout must be a JSON object, not {type(data).__name__}", {"layout": data})
    data = dict(data)
    engine = data.pop("engine", None) if "engine" in data else data.pop("kind", None)
    return layout_class(engine).model_validate(data)
