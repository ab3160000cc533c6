"""Independent checks of a plan, computed from the ops and the layouts without the compiler's own proof."""
from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from ..executors.reference import _box, block
from ..layouts import Layout
from ..planner import Plan


def write_counts(plan: Plan) -> dict[tuple[int, str], torch.Tensor]:
    """How many times the plan's ops write each destination element, per (rank, tensor)."""
    t = plan.dst_tensors
    counts = {(r, n): torch.zeros(s, dtype=torch.int32) for r, n, s in zip(t.ranks, t.names, t.shapes)}
    flats = [c.view(-1) for c in counts.values()]
    columns = ("dst_tensor", "dst_offset", "dst_stride", "rows", "cols")
    for dt, do, ds, rows, cols in zip(*(plan.ops[c].tolist() for c in columns)):
        block(flats[dt], do, rows, cols, ds).add_(1)
    return counts


def _placements(layout: Layout, names: set[str] | None) -> Iterator[Any]:
    return (p for t in layout.model.tensors if names is None or t.name in names for p in layout.placements(t))


def data_mask(layout: Layout, names: set[str] | None = None) -> dict[tuple[int, str], torch.Tensor]:
    """1 where the layout places model data (of the canonical tensors in `names`, default all), else 0."""
    masks = {(r, n): torch.zeros(s, dtype=torch.int32)
             for r in range(layout.num_ranks) for n, s in layout.rank_tensors(r).items()}
    for p in _placements(layout, names):
        if 0 not in p.lengths:
            _box(masks[(p.rank, p.tensor)], p.phys_offset, p.lengths).add_(1)
    return masks


def data_bytes_by_rank(layout: Layout, names: set[str] | None = None) -> list[int]:
    """Each rank's share of model data in bytes, from the placements."""
    out = [0] * layout.num_ranks
    for p in _placements(layout, names):
        out[p.rank] += math.prod(p.lengths) * layout.model.itemsize
    return out


def relays_read_received_data(plan: Plan) -> list[str]:
    """Problems with relay ops: each must read, from its sender's destination tensor, elements that an op of an
    earlier stage wrote there."""
    written = [torch.full(s, -1, dtype=torch.int64).view(-1) for s in plan.dst_tensors.shapes]
    o = plan.ops
    cols = [o[c].tolist() for c in ("stage", "dst_tensor", "dst_offset", "dst_stride", "rows", "cols")]
    for st, dt, do, ds, rows, cols_ in zip(*cols):
        block(written[dt], do, rows, cols_, ds).fill_(st)
    problems = []
    rel = [o[c].tolist() for c in ("stage", "src_side", "src_rank", "src_tensor", "src_offset", "src_stride", "rows",
                                   "cols")]
    for st, side, sr, stn, so, ss, rows, cols_ in zip(*rel):
        if side != 1:
            continue
        if plan.dst_tensors.rank[stn] != sr:
            problems.append(f"relay from rank {sr} reads tensor {stn} of rank {plan.dst_tensors.rank[stn]}")
            continue
        got = block(written[stn], so, rows, cols_, ss)
        if int(got.min()) < 0 or int(got.max()) >= st:
            problems.append(f"stage {st} relay from rank {sr} reads data written in stages "
                            f"[{int(got.min())}, {int(got.max())}]")
    return problems
