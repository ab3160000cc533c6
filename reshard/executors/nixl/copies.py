"""Running a schedule's block copies with torch, over memories named (kind, id)."""
from __future__ import annotations

from typing import Callable

import torch


def run_copies(rows: list[tuple[int, ...]], memory: Callable[[int, int], torch.Tensor]) -> None:
    """Run copies given as `Copies.rows_as_lists()`; `memory(kind, id)` is a flat (1-D) tensor."""
    for sk, si, so, ss, dk, di, do, ds, r, c in rows:
        s, d = memory(sk, si), memory(dk, di)
        if r == 1:
            d.narrow(0, do, c).copy_(s.narrow(0, so, c))
        else:
            d.as_strided((r, c), (ds, 1), d.storage_offset() + do).copy_(
                s.as_strided((r, c), (ss, 1), s.storage_offset() + so))
