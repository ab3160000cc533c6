"""A process's tensors made ready for an executor, written once for every executor: checked against the plan
(`check_tensors`, `check_memory`, and the binding's ranks), seen in the plan's units (`in_units`) and kept as flat
views by tensor id (the SRC / DST memory of executors.copies).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ..errors import ExecutionError
from ..planner import Plan
from .base import RankTensors
from .preflight import check_memory
from .reference import check_tensors, in_units, op_blocks, shift_views, torch_dtype
from .partition import carve

ALIGN = 64  # elements: every arena region starts 128-byte aligned (bf16) so that word views apply


class Prepared:
    """A process's tensors, checked and viewed (module docstring).

    Args:
        ranks: (source ranks, destination ranks) `src` / `dst` must give exactly; None: any.
        ids: (source ids, destination ids): check only these tensors; None: every tensor of the ranks given.

    Raises:
        ExecutionError: other ranks than the binding's, tensors that do not match the plan, overlapping or
            memoryless tensors.
    """

    def __init__(self, plan: Plan, src: RankTensors, dst: RankTensors,
                 ranks: "tuple[tuple[int, ...], tuple[int, ...]] | None" = None,
                 ids: "tuple | None" = None) -> None:
        wrong = [f"{side} ranks given {sorted(got)}, but the binding has this process play {sorted(want)}"
                 for side, got, want in zip(("source", "destination"), (src, dst), ranks or ((), ()))
                 if set(got) != set(want)] if ranks is not None else []
        if wrong:
            raise ExecutionError("; ".join(wrong))
        check_tensors(plan, src, dst, ids)
        check_memory(src, dst)
        self.plan, self.src, self.dst = plan, src, dst
        self.tensors = [t for side in (src, dst) for ts in side.values() for t in ts.values()]
        self.devices = {t.device for t in self.tensors}
        units = in_units(plan, src, dst)  # tensors kept in a wider dtype, seen in the plan's
        self.src_flat, self.dst_flat = ({i: ts[r][n].view(-1) for i, (r, n) in enumerate(zip(table.ranks, table.names))
                                         if r in ts and n in ts[r]}  # tensor id -> flat view, where given
                                        for table, ts in ((plan.src_tensors, units[0]), (plan.dst_tensors, units[1])))
        self.dtype = torch_dtype(plan.dst.dtype)

    @property
    def device(self) -> "torch.device | None":
        """The one device of the tensors (None: no tensors); ExecutionError if they are on several."""
        if len(self.devices) > 1:
            raise ExecutionError(f"this process's tensors are on several devices {sorted(map(str, self.devices))}")
        return next(iter(self.devices), None)

    def shifts(self, ops: "np.ndarray | None" = None) -> list[tuple[torch.Tensor, float]]:
        """(view, value) of the value shifts of the destination blocks of `ops` (default every op) held here."""
        return shift_views(self.plan, self.dst_flat, ops)

    def blocks(self, ops: np.ndarray, side: str = "src", flat: "dict[int, torch.Tensor] | None" = None) \
            -> list[torch.Tensor]:
        """The blocks `ops` read (side "src") or write ("dst"), in op order, as views of `flat` (default this
        process's tensors of that side)."""
        flat = flat if flat is not None else (self.src_flat if side == "src" else self.dst_flat)
        return op_blocks(self.plan, ops, side, flat)

    def arena(self, sizes: "dict[object, int]", device: "torch.device | None" = None,
              allocate: "Callable[[int], torch.Tensor] | None" = None) \
            -> tuple[torch.Tensor, dict[object, torch.Tensor]]:
        """One buffer holding a region of `sizes[key]` elements per key, each start ALIGN-aligned; returns it and
        each key's view. `allocate(numel)` makes the buffer (default: uninitialised, on `device` or the tensors')."""
        starts, total = carve(list(sizes.values()), ALIGN) if sizes else ([], 0)
        buffer = (allocate or (lambda n: torch.empty(n, dtype=self.dtype, device=device or self.device or "cpu")))(
            total)
        return buffer, {k: buffer.narrow(0, a, n) for (k, n), a in zip(sizes.items(), starts)}


__all__ = ["ALIGN", "Prepared"]
