"""Check a live model (its ModelFacts) against a declared MegatronLayout before anything moves, reporting every
problem at once in one LayoutMismatchError: the config against the spec, the derived layout against the
declared one, this rank's tensors (persistent buffers included) against the layout's, and layer positions. A
LoRA adapter's layout is checked against the adapter's parameters only.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from ...errors import LayoutMismatchError
from ...executors.reference import torch_dtype
from ...layouts import MegatronLayout
from ...layouts.lora import FAMILY as LORA
from .derive import derive_layout
from .model import read_model
from .spec import spec_problems


ADAPTER = ".adapter."  # Megatron-Bridge's adapters: <module>.adapter.linear_in / linear_out


def layout_problems(derived: MegatronLayout, declared: MegatronLayout) -> list[str]:
    """Every field where the layout derived from the live model differs from the declared one."""
    problems = []
    fields = ("tp", "pp", "ep", "etp", "world", "vpp", "first_stage_layers", "last_stage_layers", "naming",
              "rank_order") + (() if declared.model.family == LORA else ("padded_vocab",))
    for field in fields:
        got, want = getattr(derived, field), getattr(declared, field)
        if got != want:
            problems.append(f"{field}: the model has {got}, the declared layout {want}")
    return problems


def rank_problems(layout: MegatronLayout, rank: int, tensors: Mapping[str, torch.Tensor],
                  cast: bool = False) -> list[str]:
    """Names, shapes and dtypes of one rank's live tensors against the layout's physical tensors of that rank."""
    want = layout.rank_tensors(rank)
    problems = []
    for name, shape in want.items():
        dtype = torch_dtype(layout.tensor_dtype(rank, name))  # the router's float32 expert bias: its own
        t = tensors.get(name)
        if t is None:
            problems.append(f"rank {rank}: {name} {shape} is in the layout but not in the model")
        elif tuple(t.shape) != tuple(shape):
            problems.append(f"rank {rank}: {name} has shape {tuple(t.shape)} in the model, {tuple(shape)} in "
                            "the layout")
        elif t.dtype != dtype and not cast:
            problems.append(f"rank {rank}: {name} is {t.dtype} in the model, {dtype} in the layout (cast=True "
                            "converts it, which copies)")
    for name in tensors.keys() - want.keys():
        problems.append(f"rank {rank}: {name} {tuple(tensors[name].shape)} is in the model but not in the layout "
                        "(a refit would not read it)")
    return problems


def layer_problems(layout: MegatronLayout, rank: int, numbers: Mapping[tuple[int, int], int]) -> list[str]:
    """Each live layer (chunk c, index i) with global number n must be where the layout puts layer n."""
    stage = layout.dense_coords(rank)["pp"]
    problems = []
    for (chunk, index), layer in sorted(numbers.items()):
        if not 0 <= layer < layout.model.num_layers:
            problems.append(f"rank {rank}: chunk {chunk} decoder.layers.{index} is layer {layer}, outside the "
                            f"spec's {layout.model.num_layers} layers")
        elif layout.layer_home(layer) != (stage, chunk, index):
            s, c, i = layout.layer_home(layer)
            problems.append(f"rank {rank}: chunk {chunk} decoder.layers.{index} is layer {layer} in the model; the "
                            f"layout puts layer {layer} at stage {s}, chunk {c}, decoder.layers.{i}")
    return problems


def verify(model: Any, declared: MegatronLayout, *, cast: bool = False) -> MegatronLayout:
    """Derive `model`'s layout, check it and this rank's tensors against `declared` (LayoutMismatchError); return it."""
    facts = read_model(model)
    rank = facts.parallel_state.rank
    derived = derive_layout(facts, declared.model, like=declared)
    differences = layout_problems(derived, declared)
    problems = spec_problems(facts, declared.model) + differences
    if rank < declared.num_ranks:
        placed = declared.rank_tensors(rank)
        ours = (lambda n: ADAPTER in n) if declared.model.family == LORA else (lambda n: True)  # noqa: E731
        mine = {n: t for n, t in facts.tensors.items() if ours(n)}
        unplaced = {n: b for n, b in facts.buffers.items() if n not in placed and ours(n)}
        problems += rank_problems(declared, rank, {n: t for n, t in mine.items() if n not in unplaced}, cast)
        problems += [f"rank {rank}: buffer {n} {tuple(b.shape)} holds model state the layout does not place "
                     "(a refit would drop it)" for n, b in unplaced.items()]
        if not differences:  # otherwise a different pipeline split already says why layers moved
            problems += layer_problems(declared, rank, facts.layers)
    if problems:
        raise LayoutMismatchError("megatron", problems)
    return derived
