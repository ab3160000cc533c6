"""Direct mode: a plan writes straight into a live vLLM model's parameter storage.

    binding = bind_direct(model, layout, rank)             # checks, then binds; raises before anything moves
    transport.run(plan, {rank: binding.tensors})           # any executor: name -> tensor of this rank
    binding.finish()                                       # vocab padding rows zeroed, widened tensors cast

A parameter kept in a wider float type than the plan's (check.widens) is bound to scratch in the plan's dtype and
cast into the parameter by `finish`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ...errors import KernelFormatError
from ...executors.reference import torch_dtype
from ...layouts import Layout
from .check import check_layout
from .derive import declared_placements
from .kernel_format import relaid_problems
from .live import weights


@dataclass
class DirectBinding:
    """A worker's destination tensors bound to the live storage of its vLLM model's parameters (install
    "direct"), with the padding no placement covers and the wider storages a cast lands in."""

    rank: int
    layout: Layout
    tensors: dict[str, torch.Tensor]  # the live storage of each parameter (param.data), plan destination names
    model: torch.nn.Module
    padding: dict[str, list[tuple[int, int]]]  # name -> flat (start, length) runs no placement covers
    casts: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> the wider parameter storage

    def verify(self) -> None:
        """Raise KernelFormatError if a bound tensor is no longer the storage its parameter uses."""
        live = weights(self.model)
        problems = [f"{name}: the model no longer has this parameter" for name in sorted(set(self.tensors) - set(live))]
        for name, t in self.tensors.items():
            p = live.get(name)
            if p is None:
                continue
            t = self.casts.get(name, t)
            if p.data.data_ptr() != t.data_ptr() or p.shape != t.shape or p.dtype != t.dtype:
                problems.append(f"{name}: the parameter's storage changed since it was bound "
                                f"(now {tuple(p.shape)} {p.dtype} at another address)")
        if problems:
            raise KernelFormatError(str(self.layout), problems, where=f"rank {self.rank} of the live vLLM model")

    @torch.no_grad()
    def zero_padding(self) -> None:
        """Zero the padding runs of the bound tensors (a direct refit never writes them)."""
        for name, runs in self.padding.items():
            flat = self.tensors[name].view(-1)
            for start, length in runs:
                flat.narrow(0, start, length).zero_()

    @torch.no_grad()
    def finish(self) -> None:
        """After a refit landed: zero the padding, cast widened tensors into their parameters."""
        self.zero_padding()
        for name, target in self.casts.items():
            target.copy_(self.tensors[name])


def bind_direct(model: torch.nn.Module, layout: Layout, rank: int, layers: Sequence[int] | None = None,
                vllm_config: Any = None, loaders: bool = True) -> DirectBinding:
    """Check the live model against `layout` (structure and, unless `loaders=False`, the loaders' placements
    for `layers`, default all) and that no parameter was re-laid out; then bind its storage."""
    params = weights(model)  # read once: the checks and the binding below see the same parameters
    check_layout(model, layout, rank, layers, vllm_config, loaders, params)
    problems = relaid_problems(model, params)
    if problems:
        raise KernelFormatError(str(layout), problems, where=f"rank {rank} of the live vLLM model")
    tensors = {name: p.data for name, p in params.items()}
    want = {name: torch_dtype(layout.tensor_dtype(rank, name)) for name in tensors}  # a float32 router bias: own
    casts = {name: t for name, t in tensors.items() if t.dtype != want[name]}  # check_layout allowed only widening
    for name, t in casts.items():
        tensors[name] = torch.empty(t.shape, dtype=want[name], device=t.device)
    return DirectBinding(rank, layout, tensors, model, padding_runs(layout, rank), casts)


def padding_runs(layout: Layout, rank: int) -> dict[str, list[tuple[int, int]]]:
    """For each tensor of `rank` that placements do not fill, the flat runs of elements they leave uncovered."""
    shapes = layout.rank_tensors(rank)
    boxes: dict[str, list] = {name: [] for name in shapes}
    for _, p in declared_placements(layout, rank, layout.model.tensors):
        boxes[p.tensor].append(p)
    out = {}
    for name, shape in shapes.items():
        if sum(math.prod(p.lengths) for p in boxes[name]) >= math.prod(shape):
            continue
        mask = torch.zeros(shape, dtype=torch.bool)
        for p in boxes[name]:
            view = mask
            lead = len(shape) - len(p.lengths)
            for o in p.phys_offset[:lead]:
                view = view.select(0, o)
            for dim, (o, n) in enumerate(zip(p.phys_offset[lead:], p.lengths)):
                view = view.narrow(dim, o, n)
            view.fill_(True)
        out[name] = _runs(~mask.view(-1))
    return out


def _runs(flags: torch.Tensor) -> list[tuple[int, int]]:
    """(start, length) of each run of True in a 1-D bool tensor."""
    padded = torch.cat([torch.zeros(1, dtype=torch.int8), flags.to(torch.int8), torch.zeros(1, dtype=torch.int8)])
    edges = torch.diff(padded)
    starts = torch.nonzero(edges == 1).flatten().tolist()
    stops = torch.nonzero(edges == -1).flatten().tolist()
    return [(a, b - a) for a, b in zip(starts, stops)]
