"""Layouts as short strings (`megatron:tp=4,pp=2,ep=8`) and as JSON, for the CLI and for saved plans."""
from __future__ import annotations

import json
import re
import types
import typing
from typing import Any

from ..errors import LayoutError, LimitError, show
from .base import Layout
from .hf import HfLayout
from .lora import PeftLayout, VllmLoraLayout
from .megatron import MegatronLayout
from .model import ModelSpec
from .vllm import VllmLayout

# every layout kind plan files and refit specs may name (adapter layouts travel like the others)
LAYOUT_KINDS: dict[str, type[Layout]] = {cls.kind: cls for cls in (MegatronLayout, VllmLayout, HfLayout, PeftLayout,
                                                                   VllmLoraLayout)}

# Short aliases accepted in layout strings.
_ALIASES = {"ep": {"vllm": "expert_parallel"}, "first": {"megatron": "first_stage_layers"},
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


def _value(kind: str, key: str, text: str, annotation: Any) -> Any:
    """The value of one option, by the field's type: an integer, a boolean or a word; else LayoutError."""
    allowed = _base_types(annotation)
    if bool in allowed:
        if text.lower() not in _BOOLS:
            raise LayoutError(kind, f"{key}={text!r} must be true or false", {key: text})
        return _BOOLS[text.lower()]
    if int in allowed:
        if not _INT.fullmatch(text):
            raise LayoutError(kind, f"{key}={text!r} must be a whole number in ASCII digits", {key: text})
        return int(text)
    if not _WORD.fullmatch(text):
        raise LayoutError(kind, f"{key}={text!r} must be a word of letters, digits, '-' or '_'", {key: text})
    return text


def parse_layout(text: str, model: ModelSpec) -> Layout:
    """Parse a layout string such as 'vllm:tp=8,replicas=8' or 'megatron:tp=2,pp=2,ep=8,etp=1,world=16'.

    Each option once; a bare option only for a flag (e.g. 'vllm:tp=2,ep').

    Args:
        text: 'kind:key=value,...' (untrusted: length, kind, keys and values are checked).
        model: the model the layout places.

    Returns:
        The layout, validated.

    Raises:
        LayoutError: an unknown kind or option, a repeated option, a malformed value, or a layout that cannot
            exist (the message names the bad part).
        LimitError: a string or a size beyond `reshard.limits`.
    """
    if not isinstance(text, str):
        raise LayoutError("layout", f"a layout string must be a str, not {type(text).__name__}", {"layout": text})
    if not isinstance(model, ModelSpec):
        from ..errors import ArgumentError

        raise ArgumentError("model", model, "must be a ModelSpec")
    if len(text) > MAX_LAYOUT_TEXT:
        raise LimitError("layout", f"{text[:40]}...", MAX_LAYOUT_TEXT, "characters of a layout string")
    kind, _, rest = text.partition(":")
    kind = kind.strip().lower()
    if kind == "megatron-ckpt":  # derived from a checkpoint's files, which layouts never read
        raise LayoutError(kind, "a checkpoint's layout is derived from its metadata, not declared",
                          {"layout": text}, fix="use reshard.adapters.megatron.checkpoint_layout(open_checkpoint("
                          "path), spec), or `reshard plan --src megatron-ckpt:PATH`")
    if kind not in LAYOUT_KINDS:
        raise LayoutError(kind or text, f"unknown layout kind {kind!r}; expected one of {sorted(LAYOUT_KINDS)}",
                          {"kind": kind})
    cls = LAYOUT_KINDS[kind]
    known = sorted(k for k in cls.model_fields if k != "model")
    fields: dict[str, Any] = {}
    for item in (s.strip() for s in rest.split(",")):
        if not item:
            if rest.strip():
                raise LayoutError(kind, f"empty option in {text!r} (two commas, or a trailing one)", {"layout": text})
            continue
        raw, eq, val = item.partition("=")
        key = _ALIASES.get(raw.strip(), {}).get(kind, raw.strip())
        if key in _NOT_IN_STRINGS.get(kind, {}):
            raise LayoutError(kind, f"option {raw.strip()!r}: {_NOT_IN_STRINGS[kind][key]}", {key: val})
        if key not in cls.model_fields or key == "model":
            raise LayoutError(kind, f"unknown option {raw.strip()!r}; {kind} layouts take {known}",
                              {raw.strip(): val})
        if key in fields:
            raise LayoutError(kind, f"option {raw.strip()!r} is given twice in {text!r}", {key: val})
        annotation = cls.model_fields[key].annotation
        if not eq:
            if bool not in _base_types(annotation):
                raise LayoutError(kind, f"option {key!r} needs a value ({key}=...); only flags may stand alone",
                                  {key: None})
            fields[key] = True
            continue
        fields[key] = _value(kind, key, val.strip(), annotation)
    return cls(model=model, **fields)


def layout_to_dict(layout: Layout) -> dict[str, Any]:
    if not isinstance(layout, Layout):
        raise LayoutError("layout", f"layout={show(layout)} must be a Layout", {"layout": layout})
    return {"kind": layout.kind, **json.loads(layout.model_dump_json())}


def layout_from_dict(data: dict[str, Any]) -> Layout:
    if not isinstance(data, dict):
        raise LayoutError("layout", f"a layout must be a JSON object, not {type(data).__name__}", {"layout": data})
    data = dict(data)
    kind = data.pop("kind", None)
    if not isinstance(kind, str) or kind not in LAYOUT_KINDS:
        raise LayoutError(str(kind), f"unknown layout kind {kind!r}; expected one of {sorted(LAYOUT_KINDS)}",
                          {"kind": kind})
    return LAYOUT_KINDS[kind].model_validate(data)
