"""The local executor for small, frequent refits (LoRA adapters): every block view is made once, at
construction, and a refit is one batched copy of all of them.

The reference `LocalExecutor` checks the tensors and walks the ops in Python at every refit: right for a whole
model (gigabytes; a few thousand ops), a fixed cost that dominates a refit of megabytes. Here construction does the
checks and builds the source and destination views of every op (and of every value shift); `refit` runs
`torch._foreach_copy_` over them, which on a GPU launches the copies without a Python loop. The tensors must stay
the same objects between refits (the trainer updates them in place; a slot buffer stays where the engine made it):
`refit` checks their storage pointers, a constant-time test, and refuses if one was replaced.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import ExecutionError
from ..planner import Plan
from ..planner.plan import RELAY
from .base import Executor, RankTensors
from .guard import check_memory, check_ops
from .local import apply_shifts, block, check_tensors, in_units, shift_views


class BoundLocalExecutor(Executor):
    """Every rank in this process, views bound once (see the module docstring). `binding` and `process` are
    accepted for the protocol of executors.base and not needed."""

    name = "bound"

    def __init__(self, plan: Plan, binding: object = None, process: int = 0, src: RankTensors | None = None,
                 dst: RankTensors | None = None) -> None:
        self.plan, src, dst = plan, dict(src or {}), dict(dst or {})
        check_ops(plan)
        o = plan.ops
        mine = np.flatnonzero(np.isin(o["dst_rank"], list(dst)))
        if np.any(o["src_side"][mine] == RELAY):
            raise ExecutionError("the plan relays between destination replicas; compile it without fan-out to "
                                 "run it bound in one process")
        missing = sorted(set(o["src_rank"][mine].tolist()) - set(src))
        if missing:
            raise ExecutionError(f"this process lacks source ranks {missing[:10]} that the plan reads")
        used = sorted(set(o["src_rank"][mine].tolist()))
        src = {r: src[r] for r in used}
        check_tensors(plan, src, dst)
        check_memory(src, dst)
        self._pins = [(t, t.data_ptr()) for side in (src, dst) for ts in side.values() for t in ts.values()]
        s_units, d_units = in_units(plan, src, dst)
        s_flat = {i: s_units[r][n].view(-1) for i, (r, n) in enumerate(zip(plan.src_tensors.ranks,
                                                                           plan.src_tensors.names)) if r in s_units}
        d_flat = {i: d_units[r][n].view(-1) for i, (r, n) in enumerate(zip(plan.dst_tensors.ranks,
                                                                           plan.dst_tensors.names)) if r in d_units}
        cols = [o[c][mine].tolist() for c in ("src_tensor", "src_offset", "src_stride", "dst_tensor", "dst_offset",
                                             "dst_stride", "rows", "cols")]
        self._src, self._dst = [], []
        for st, so, ss, dt, do, ds, r, c in zip(*cols):
            if ss == c and ds == c:  # whole rows on both sides: one contiguous run (foreach's fused path)
                r, c = 1, r * c
            self._src.append(block(s_flat[st], so, r, c, ss))
            self._dst.append(block(d_flat[dt], do, r, c, ds))
        self._shifts = shift_views(plan, d_flat, mine)
        self.bytes = int(sum(v.numel() * v.element_size() for v in self._dst))

    def refit(self, version: int | None = None) -> dict[str, Any]:
        moved = [t for t, ptr in self._pins if t.data_ptr() != ptr]
        if moved:
            raise ExecutionError(f"{len(moved)} bound tensors were replaced since the executor was made; update "
                                 f"them in place, or make a new executor")
        with torch.no_grad():
            if self._dst:
                torch._foreach_copy_(self._dst, self._src)
            apply_shifts(self._shifts)
        return {"ops": len(self._dst), "bytes": self.bytes}

    def close(self) -> None:
        self._src, self._dst, self._shifts, self._pins = [], [], [], []
