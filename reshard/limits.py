"""Bounds no real model, cluster or plan reaches, checked before anything is allocated (a hostile size cannot
exhaust memory or overflow int64). Each leaves two to four orders of magnitude above the largest published models
(hidden ~2**14, vocabulary ~2**18, ~10**12 parameters) and clusters (~2**17 accelerators).
"""
from __future__ import annotations

from typing import Any

from .errors import LimitError

MAX_DIM = 1 << 24  # any one dimension of a tensor: hidden size, vocabulary, heads x head_dim, ...
MAX_HEADS = 1 << 16  # attention / key-value / linear-attention heads
MAX_LAYERS = 1 << 12
MAX_EXPERTS = 1 << 14
MAX_TENSORS = 1 << 22  # canonical tensors of one model (layers x experts x 3 ...)
MAX_PARAMS = 1 << 47  # elements of one model (~1.4e14)
MAX_RANKS = 1 << 17  # ranks of one side of a refit (world, tp x replicas)
MAX_CONFIG_BYTES = 16 << 20  # an HF config.json
MAX_JSON_DEPTH = 64  # nesting of a config or a plan header
MAX_PLAN_HEADER_BYTES = 1 << 30  # a saved plan's JSON header (tensor tables of many thousand ranks)
MAX_PLAN_ELEMENTS = 1 << 31  # elements of one array of a saved plan


def check_limit(field: str, value: int, limit: int, what: str, where: str = "") -> None:
    """Raise LimitError naming the limit if `value` exceeds it."""
    if value > limit:
        raise LimitError(field, value, limit, what, where)


def json_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """The nesting depth of a JSON value, stopping (returning limit + 1) once past `limit` (no recursion)."""
    stack, deepest = [(value, 1)], 1
    while stack:
        v, d = stack.pop()
        if d > deepest:
            deepest = d
            if deepest > limit:
                return deepest
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()  # a scalar: no nesting
        stack.extend((x, d + 1) for x in items if isinstance(x, (dict, list)))
    return deepest


__all__ = ["MAX_CONFIG_BYTES", "MAX_DIM", "MAX_EXPERTS", "MAX_HEADS", "MAX_JSON_DEPTH", "MAX_LAYERS",
           "MAX_PARAMS", "MAX_PLAN_ELEMENTS", "MAX_PLAN_HEADER_BYTES", "MAX_RANKS", "MAX_TENSORS", "check_limit",
           "json_depth"]
