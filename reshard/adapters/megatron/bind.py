"""Bind a declared layout to a live model: this rank's physical tensors as views of the live parameters (zero copy
but for a dtype change, `cast=True`, or a non-contiguous parameter).
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
    """{physical name: view of the live tensor} of this rank of `layout`, first verified with `check` (check.verify)."""
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
