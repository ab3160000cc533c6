"""What an exporter's stream of (name, tensor) may hold, mapped onto the model's HF tensors (both integrations'
`send_weights`): the model's own names, routed experts fused into 3-D tensors (transformers 5 state dicts,
Megatron-Bridge / mbridge exports; `layouts.family.routed_experts`), and extras a refit skips (FP8 KV-cache scales,
draft or MTP layers; `ModelFamily.stream_extras`). Anything else is refused, naming it.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ArgumentError
from ..executors.reference import torch_dtype
from ..layouts import ModelSpec
from ..layouts.families import family
from ..layouts.model import Experts

log = logging.getLogger("reshard.streams")


@dataclass(frozen=True)
class _Fused:
    """A fused expert tensor of one layer: for expert e, rows `rows[k]` of its slab are `names[k]` (with e)."""

    names: tuple[str, ...]  # per-expert HF name templates (`{e}`), in the slab's row order
    rows: tuple[tuple[int, int], ...]
    shape: tuple[int, int, int]  # [experts, rows, cols]


class StreamNames:
    """The names a stream may carry for one model.

    Args:
        spec: the model the plan was compiled for.
    """

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self._names = frozenset(t.name for t in spec.tensors)
        fam = family(spec.family)
        self._fused: dict[str, _Fused] = {}
        for i in range(spec.num_layers):
            for item in fam.layer(spec, i):
                for f in item.fused if isinstance(item, Experts) else ():
                    parts = [item.entries[k] for k in f.parts]
                    bounds = [0, *itertools.accumulate(e.shape[0] for e in parts)]
                    names = tuple(e.name.replace("{i}", str(i)) for e in parts)
                    self._fused[f.name.format(i=i)] = _Fused(names, tuple(zip(bounds, bounds[1:])),
                                                             (item.count, bounds[-1], parts[0].shape[1]))
        self._extras = fam.stream_extras(spec)
        self._logged: set[str] = set()

    def split(self, name: Any, tensor: Any) -> list[tuple[str, torch.Tensor]]:
        """The model's HF tensors one stream item carries, under the model's own names (so a tensor that comes twice,
        fused and per expert, is caught as repeated).

        Args:
            name, tensor: the stream item.

        Returns:
            [(name, tensor)] for one of the model's names (shape and dtype unchecked); a fused expert tensor's
            per-expert views; [] for an extra the family declares (logged once per kind).

        Raises:
            ArgumentError: a name that is none of these, or a fused tensor of the wrong shape.
        """
        if not isinstance(name, str):
            raise ArgumentError("weights", name, "is not a tensor name (a str)", fix="stream (name, tensor) pairs")
        if name in self._names:
            return [(name, tensor)]
        fused = self._fused.get(name)
        if fused is not None:
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != fused.shape:
                got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                parts = " + ".join(n.rsplit(".", 2)[-2] for n in fused.names)
                raise ArgumentError(f"weights[{name}]", got, f"is not the fused experts tensor {list(fused.shape)} "
                                    f"(experts, rows {parts}, columns)")
            return [(template.format(e=e), tensor[e, start:stop])
                    for e in range(fused.shape[0]) for template, (start, stop) in zip(fused.names, fused.rows)]
        for extra in self._extras:
            if extra.matches(name):
                if extra.what not in self._logged:
                    self._logged.add(extra.what)
                    log.warning("reshard: skipping %s (first: %s): the refit does not carry them", extra.what, name)
                return []
        example = f"; its experts may come fused ({next(iter(self._fused))})" if self._fused else ""
        raise ArgumentError("weights", name, f"is not a tensor of the {self.spec.family} model the plan was compiled "
                            f"for, nor an extra exporters add that refits skip",
                            fix=f"stream the model's HF names{example}")

    def checked(self, name: Any, tensor: Any, seen: set[str]) -> list[tuple[str, torch.Tensor]]:
        """`split`, each of the model's tensors checked: not in `seen` (then added to it), of its shape and dtype.

        Raises:
            ArgumentError: what `split` refuses, a tensor that came twice, or one of another shape or dtype.
        """
        out = self.split(name, tensor)
        for hf, piece in out:
            if hf in seen:
                raise ArgumentError("weights", hf, "came twice in the stream" + (f" (again in {name})" if name != hf
                                                                                 else ""))
            seen.add(hf)
            shape, dtype = self.expected(hf)
            if not isinstance(piece, torch.Tensor) or tuple(piece.shape) != shape or piece.dtype != dtype:
                got = (tuple(piece.shape), piece.dtype) if isinstance(piece, torch.Tensor) else type(piece).__name__
                raise ArgumentError(f"weights[{hf}]", got, f"does not match the model's {shape} {dtype}")
        return out

    def never_came(self, seen: set[str], who: str) -> ArgumentError:
        """The error of a stream that ended before every tensor of the model came (`who` streams)."""
        absent = [t.name for t in self.spec.tensors if t.name not in seen]
        return ArgumentError("weights", absent[:5], f"({len(absent)} tensors of the model) never came in the stream",
                             fix=f"the {who} must stream every tensor of the model")

    def expected(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """The shape and torch dtype of one of the model's HF tensors."""
        t = self.spec.tensor(name)
        return tuple(t.shape), torch_dtype(t.dtype or self.spec.dtype)


__all__ = ["StreamNames"]
