"""Bind a declared layout to a live model: this rank's physical tensors as views of the live parameters.

Zero copy: each tensor returned shares storage with its parameter (same data_ptr); nothing is gathered and no
copy of the model is made, so a refit reads the trainer's current weights in place. Two cases copy, and only
for the tensors concerned: a dtype change (`cast=True`, e.g. fp32 parameters into a bf16 destination), and a
non-contiguous parameter (megatron-core's parameters, and megatron DDP's buffer-backed ones, are contiguous).
The executors send from these tensors without writing to them.
"""
from __future__ import annotations

from typing import Any

import torch

from ...executors.reference import torch_dtype
from ...layouts import MegatronLayout
from .check import verify
from .model import read_model


def source_tensors(model: Any, layout: MegatronLayout, *, cast: bool = False,
                   check: bool = True) -> dict[str, torch.Tensor]:
    """{physical name: tensor} of this rank of `layout`, read from `model` (a GPTModel, possibly wrapped, the list
    of its virtual pipeline chunks, or the ModelFacts read off it: the model is read once either way). With
    `check` (the default) the model is first verified against the layout (see check.verify) and any mismatch
    raises LayoutMismatchError before a tensor is handed out."""
    facts = read_model(model)
    if check:
        verify(facts, layout, cast=cast)
    tensors = facts.tensors  # parameters and placed persistent buffers (the router's expert_bias)
    rank = facts.parallel_state.rank
    out = {}
    for name in layout.rank_tensors(rank):
        t = tensors[name].detach()  # a view: same storage, no autograd history
        dtype = torch_dtype(layout.tensor_dtype(rank, name))  # the router's float32 expert bias: its own
        if t.dtype != dtype:
            t = t.to(dtype)  # copy: the destination dtype differs (allowed by cast=True)
        out[name] = t.contiguous()  # a no-op for megatron-core's contiguous parameters
    return out
