"""The storage addresses of tensors bound into prepared copies, re-checked before each launch: a tensor whose
storage was replaced (`.data = ...`, `set_`) would be written through stale addresses. C-level maps keep the check
at tens of nanoseconds a tensor.
"""
from __future__ import annotations

import operator
from typing import Iterable

import torch

from ..errors import ExecutionError

_data_ptr = torch.Tensor.data_ptr


class Pins:
    """The addresses of `tensors` now; `check()` refuses once any of them moved."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        self.tensors = tuple(tensors)
        self.addresses = tuple(map(_data_ptr, self.tensors))

    def moved(self) -> int:
        """How many of the tensors' storages were replaced since."""
        now = tuple(map(_data_ptr, self.tensors))
        return 0 if now == self.addresses else sum(map(operator.ne, now, self.addresses))

    def check(self) -> None:
        """Raise ExecutionError if any pinned tensor's storage was replaced since."""
        moved = self.moved()
        if moved:
            raise ExecutionError(f"{moved} bound tensors were replaced since the executor was made; update them in "
                                 f"place, or make a new executor")


__all__ = ["Pins"]
