"""The reference executor: run a plan over in-memory tensors, every rank in one process; and `shard` / `unshard`,
which lay canonical weights out by a layout and back from its placements alone (no compiler): the reference plans
are tested against.
"""
from __future__ import annotations

import math
import time

from typing import Any, Iterator, Mapping

import numpy as np
import torch

from ..arguments import device as check_device, instance, integer, rank_tensors, ranks as check_ranks
from ..errors import ArgumentError, ExecutionError
from ..layouts import Layout
from ..planner import Plan
from ..planner.plan import RELAY
from .base import Executor, RankTensors, RefitStats
from .binding import Binding
from .copies import copy_view
from .preflight import check_ops


TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                "float8_e4m3fn": getattr(torch, "float8_e4m3fn", None)}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a plan's dtype name; ExecutionError if torch here has none."""
    dtype = TORCH_DTYPES.get(name)
    if dtype is None:
        raise ExecutionError(f"dtype {name!r} has no torch equivalent here")
    return dtype


def allocate(layout: Layout, fill: float = 0.0, ranks: list[int] | None = None,
             device: str | torch.device = "cpu") -> dict[int, dict[str, torch.Tensor]]:
    """Fresh physical tensors for some ranks of a layout, each in its dtype, filled with one value.

    Args:
        layout: the layout.
        fill: the value of every element.
        ranks: the ranks (default all).
        device: where the tensors live.

    Returns:
        rank -> physical name -> tensor (the layout's dtype, or a tensor's own: `Layout.tensor_dtypes`).

    Raises:
        LayoutError: a rank the layout does not have.
        ArgumentError: a `fill` that is not a value of every dtype of the layout's tensors (NaN and infinities
            pass for floating dtypes).
    """
    instance("layout", layout, Layout, "a Layout")
    ranks = check_ranks("ranks", ranks, layout.num_ranks)
    device = check_device("device", device)
    if isinstance(fill, bool) or not isinstance(fill, (int, float)):
        raise ArgumentError("fill", fill, "must be a real number (an int or a float)")
    if isinstance(fill, int) and not -(1 << 63) <= fill < (1 << 63):
        raise ArgumentError("fill", fill, "is not a value of any tensor dtype")
    for name in {layout.dtype, *layout.tensor_dtypes().values()}:
        dtype = torch_dtype(name)
        if dtype.is_floating_point and not math.isfinite(fill):
            continue
        info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
        if not info.min <= fill <= info.max or (not dtype.is_floating_point and fill != int(fill)):
            raise ArgumentError("fill", fill, f"is not a value of the layout's dtype {name}")
    return {r: {name: torch.full(shape, fill, device=device, dtype=torch_dtype(layout.tensor_dtype(r, name)))
                for name, shape in layout.rank_tensors(r).items()}
            for r in (range(layout.num_ranks) if ranks is None else ranks)}


def _box(t: torch.Tensor, offset: tuple[int, ...], lengths: tuple[int, ...]) -> torch.Tensor:
    """The view of `t` at a box whose lengths align with t's trailing dimensions."""
    lead = t.dim() - len(lengths)
    view = t
    for o in offset[:lead]:  # leading dimensions of length 1 (an expert's slot in a stack)
        view = view.select(0, o)
    for dim, (o, n) in enumerate(zip(offset[lead:], lengths)):
        view = view.narrow(dim, o, n)
    return view


def _boxes(layout: Layout, t: Any, tensors: RankTensors) -> Iterator[tuple[tuple[slice, ...], torch.Tensor]]:
    """(canonical index, physical box view) of every non-empty placement of canonical tensor `t` on a rank that
    `tensors` holds."""
    for p in layout.placements(t):
        if p.rank in tensors and 0 not in p.lengths:
            yield (tuple(slice(o, o + n) for o, n in zip(p.canon_offset, p.lengths)),
                   _box(tensors[p.rank][p.tensor], p.phys_offset, p.lengths))


def shard(layout: Layout, weights: Mapping[str, torch.Tensor], fill: float = 0.0,
          ranks: list[int] | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """Lay canonical weights out as `layout` says.

    Args:
        layout: the layout.
        weights: canonical tensors by HF name (every tensor of the model).
        fill: the value of padding elements.
        ranks: the ranks to make (default all).

    Returns:
        rank -> physical name -> tensor.

    Raises:
        ArgumentError: a canonical tensor missing from `weights`, or one whose shape is not the canonical one
            (a shape that merely broadcasts to it is refused, never broadcast).
    """
    instance("layout", layout, Layout, "a Layout")
    if not isinstance(weights, Mapping) or not all(isinstance(k, str) for k in weights):
        raise ArgumentError("weights", weights, "must map canonical (HF) tensor names to torch tensors")
    problems = []
    for t in layout.model.tensors:
        w = weights.get(t.name)
        if not isinstance(w, torch.Tensor):
            problems.append(f"{t.name!r} is {'missing' if w is None else type(w).__name__}")
        elif tuple(w.shape) != tuple(t.shape):
            problems.append(f"{t.name!r} has shape {tuple(w.shape)}, the model's is {tuple(t.shape)}")
    if problems:
        raise ArgumentError("weights", f"<{len(weights)} tensors>",
                            f"must hold every tensor of the model in its canonical shape: {'; '.join(problems[:5])}"
                            + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))
    out = allocate(layout, fill, ranks)
    for t in layout.model.tensors:
        for index, box in _boxes(layout, t, out):
            box.copy_(weights[t.name][index])
            if layout.value_offset(t):
                box.add_(layout.value_offset(t))
    return out


def unshard(layout: Layout, tensors: RankTensors) -> dict[str, torch.Tensor]:
    """Canonical weights read back from a layout's tensors (each box from its first holder).

    Args:
        layout: the layout.
        tensors: rank -> physical name -> tensor (ranks may be missing: their boxes stay uninitialized).

    Returns:
        HF name -> canonical tensor.

    Raises:
        ArgumentError: a physical tensor missing from a rank that is given, or of another shape.
    """
    instance("layout", layout, Layout, "a Layout")
    rank_tensors("tensors", tensors, deep=True)
    problems = [f"rank {r} {name!r}: {tuple(tensors[r][name].shape) if name in tensors[r] else 'missing'}, "
                f"the layout has {shape}" for r in tensors if 0 <= r < layout.num_ranks
                for name, shape in layout.rank_tensors(r).items()
                if name not in tensors[r] or tuple(tensors[r][name].shape) != tuple(shape)]
    unknown = sorted(r for r in tensors if not 0 <= r < layout.num_ranks)
    if unknown or problems:
        raise ArgumentError("tensors", f"<{len(tensors)} ranks>",
                            f"ranks {unknown} are not ranks of {layout}" if unknown else
                            "do not match the layout: " + "; ".join(problems[:5]))
    out = {}
    for t in layout.model.tensors:
        w = torch.empty(t.shape, dtype=torch_dtype(t.dtype or layout.dtype))
        for index, box in _boxes(layout, t, tensors):
            w[index] = box
        out[t.name] = w - layout.value_offset(t) if layout.value_offset(t) else w
    return out


def check_tensors(plan: Plan, src: RankTensors, dst: RankTensors, ids: "tuple | None" = None) -> None:
    """Raise ExecutionError, listing every problem, unless each tensor the plan touches is there, contiguous, in
    its shape and dtype (its own, where the table keeps one). `ids`: (source ids, destination ids) to check only."""
    problems = []
    for k, (side, table, given, layout) in enumerate((("source", plan.src_tensors, src, plan.src),
                                                      ("destination", plan.dst_tensors, dst, plan.dst))):
        plan_dtype, own = torch_dtype(layout.dtype), table.own_dtypes()
        only = None if ids is None else set(ids[k])
        for i, (rank, name, shape) in enumerate(zip(table.ranks, table.names, table.shapes)):
            if rank not in given or (only is not None and i not in only):
                continue  # ranks not given are not run here
            if not isinstance(given[rank], Mapping):
                problems.append(f"{side} rank {rank} must map tensor names to tensors, not "
                                f"{type(given[rank]).__name__}")
                continue
            t = given[rank].get(name)
            want_dtype = torch_dtype(own[(rank, name)]) if (rank, name) in own else plan_dtype
            shape = element_shape(shape, plan_dtype, want_dtype)
            if t is None:
                problems.append(f"{side} rank {rank} has no tensor {name!r}")
            elif not isinstance(t, torch.Tensor):
                problems.append(f"{side} rank {rank} {name!r} is a {type(t).__name__}, not a torch.Tensor")
            elif tuple(t.shape) != tuple(shape) or t.dtype != want_dtype or not t.is_contiguous():
                problems.append(f"{side} rank {rank} {name!r}: got {tuple(t.shape)} {t.dtype} "
                                f"(contiguous={t.is_contiguous()}), plan expects {tuple(shape)} {want_dtype}")
    if problems:
        raise ExecutionError("tensors do not match the plan:\n  - " + "\n  - ".join(problems[:20]))


def element_shape(units: tuple[int, ...], unit: torch.dtype, dtype: torch.dtype) -> tuple[int, ...]:
    """The shape of a tensor in `dtype` whose shape in a plan's tables, counted in `unit`s, is `units`."""
    if dtype == unit:
        return tuple(units)
    return (*units[:-1], units[-1] * unit.itemsize // dtype.itemsize)


def empty_for(plan: Plan, rank: int, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Uninitialised destination tensors of one rank of a plan (its tensor table's), each in its dtype and shape."""
    unit, own = torch_dtype(plan.dst.dtype), plan.dst_tensors.own_dtypes()
    out = {}
    for name, shape in plan.dst_tensors.on_rank(rank).items():
        dtype = torch_dtype(own[(rank, name)]) if (rank, name) in own else unit
        out[name] = torch.empty(element_shape(shape, unit, dtype), dtype=dtype, device=device)
    return out


def in_units(plan: Plan, src: RankTensors, dst: RankTensors) -> tuple[RankTensors, RankTensors]:
    """The tensors as executors move them: those kept in a wider dtype than the plan's viewed in the plan's dtype
    (a float32 [E] as bfloat16 [2E])."""
    unit = torch_dtype(plan.dst.dtype)
    sides = ((src, plan.src_tensors.own_dtypes()), (dst, plan.dst_tensors.own_dtypes()))
    return tuple({r: {n: t.view(unit) if (r, n) in own else t for n, t in ts.items()} for r, ts in side.items()}
                 if own else side for side, own in sides)


def block(flat: torch.Tensor, offset: int, rows: int, cols: int, stride: int) -> torch.Tensor:
    """The rows x cols block at `offset` of a flat (1-D) view, rows `stride` apart."""
    return copy_view(flat, offset, 0, stride, 1, rows, cols)


def op_blocks(plan: Plan, ops: "np.ndarray | list[int]", side: str, flat: Mapping[int, torch.Tensor]) \
        -> list[torch.Tensor]:
    """The blocks the plan ops `ops` read (side "src") or write ("dst"), in that order, as views of `flat`
    (tensor id -> flat view)."""
    o = plan.ops
    return [block(flat[int(o[f"{side}_tensor"][i])], int(o[f"{side}_offset"][i]), int(o["rows"][i]),
                  int(o["cols"][i]), int(o[f"{side}_stride"][i])) for i in np.asarray(ops, dtype=np.int64).tolist()]


class ReferenceExecutor(Executor):
    """Every op of a plan in this process: the reference the other executors are tested against.

    The tensors are checked before any byte moves; the copies then write `dst` directly.

    Args:
        plan: the plan.
        binding: not needed (the executor protocol's).
        process: not needed (the executor protocol's).
        src: the source ranks' tensors (rank -> name -> tensor).
        dst: the destination ranks' tensors.

    Raises:
        ExecutionError: the plan relays through ranks not given, a source rank is missing, or tensors that do not
            match the plan.
    """

    name = "reference"

    def __init__(self, plan: Plan, binding: object = None, process: int = 0, src: RankTensors | None = None,
                 dst: RankTensors | None = None) -> None:
        instance("plan", plan, Plan, "a Plan")
        instance("binding", binding, Binding, "a Binding (not needed here)", none=True)
        integer("process", process, 0, 1 << 20)
        rank_tensors("src", src, none=True)
        rank_tensors("dst", dst, none=True)
        self.plan, self.src, self.dst = plan, dict(src or {}), dict(dst or {})
        for side, given, layout in (("src", self.src, plan.src), ("dst", self.dst, plan.dst)):
            unknown = sorted(r for r in given if not 0 <= r < layout.num_ranks)
            if unknown:
                raise ExecutionError(f"{side} names ranks {unknown[:10]} that the plan's {layout.engine} side does "
                                     f"not have")
        self.mine, self.sources = ops_here(plan, self.src, self.dst)
        check_tensors(plan, {r: self.src[r] for r in self.sources}, self.dst)  # before any byte moves
        self.process, self._version = process, 0
        self._bytes = int((plan.ops["rows"][self.mine] * plan.ops["cols"][self.mine]).sum()) * plan.itemsize

    def refit(self, version: int | None = None) -> RefitStats:
        start = time.perf_counter()
        plan, ops, mine = self.plan, self.plan.ops, self.mine
        from .partition import Prepared

        prepared = Prepared(plan, {r: self.src[r] for r in self.sources}, self.dst)
        s_flat, d_flat = prepared.src_flat, prepared.dst_flat
        cols = [ops[c][mine].tolist() for c in ("src_side", "src_tensor", "src_offset", "src_stride", "dst_tensor",
                                                "dst_offset", "dst_stride", "rows", "cols")]
        sides = (s_flat, d_flat)  # relays (side 1) read a destination tensor written in an earlier stage
        with torch.no_grad():
            for side, st, so, ss, dt, do, ds, r, c in zip(*cols):  # ops are in stage order
                block(d_flat[dt], do, r, c, ds).copy_(block(sides[side][st], so, r, c, ss))
            apply_shifts(prepared.shifts(mine))
        self._version = self._version + 1 if version is None else int(version)
        seconds = time.perf_counter() - start
        return RefitStats(executor=self.name, process=self.process, version=self._version, seconds=seconds,
                          phases={"copy": seconds}, ops=len(mine), copies=len(mine), local_bytes=self._bytes)


def execute_local(plan: Plan, src: RankTensors, dst: RankTensors) -> None:
    """One refit with every rank in this process (the reference the other executors are tested against).

    Args:
        plan: the plan.
        src: every source rank's tensors.
        dst: every destination rank's tensors.

    Raises:
        ExecutionError: a rank is missing, or tensors that do not match the plan.
    """
    rank_tensors("src", src)
    rank_tensors("dst", dst)
    executor = ReferenceExecutor(plan, None, 0, src, dst)  # checks the plan and the tensors
    missing = sorted(set(plan.src_tensors.ranks) - set(src)) + sorted(set(plan.dst_tensors.ranks) - set(dst))
    if missing:
        raise ExecutionError(f"local execution needs every rank; missing {missing[:10]}")
    executor.refit()


def ops_here(plan: Plan, src: RankTensors, dst: RankTensors, ops: "np.ndarray | None" = None) \
        -> tuple[np.ndarray, list[int]]:
    """The ops (within `ops`) that the destination ranks in `dst` receive, and the source ranks they read; the plan
    checked (preflight.check_ops).

    Raises:
        ExecutionError: a relay reads a destination rank not in `dst`, or a source rank read is not in `src`.
    """
    check_ops(plan)
    o = plan.ops
    mine = np.flatnonzero(np.isin(o["dst_rank"], list(dst)))
    if ops is not None:
        mine = np.intersect1d(mine, np.asarray(ops, dtype=np.int64))
    relay = o["src_side"][mine] == RELAY
    foreign = sorted(set(o["src_rank"][mine[relay]].tolist()) - set(dst))
    if foreign:
        raise ExecutionError(f"the plan relays through destination ranks {foreign[:10]} that are not in this "
                             f"process; compile it without fan-out to run it here")
    sources = sorted(set(o["src_rank"][mine[~relay]].tolist()))
    missing = [r for r in sources if r not in src]
    if missing:
        raise ExecutionError(f"this process lacks source ranks {missing[:10]} that the plan reads")
    return mine, sources


def shift_views(plan: Plan, dst_flat: Mapping[int, torch.Tensor], ops: "np.ndarray | None" = None) \
        -> list[tuple[torch.Tensor, float]]:
    """(view, value) for every destination block, among `ops` (default all) with their tensor in `dst_flat`, that
    the plan shifts (Plan.value_shifts)."""
    shifts = plan.value_shifts
    if not shifts:
        return []
    o = plan.ops
    idx = np.arange(plan.num_ops) if ops is None else np.asarray(ops)
    idx = idx[np.isin(o["canon"][idx], list(shifts)) & np.isin(o["dst_tensor"][idx], list(dst_flat))]
    return list(zip(op_blocks(plan, idx, "dst", dst_flat), (shifts[int(c)] for c in o["canon"][idx])))


def apply_shifts(views: list[tuple[torch.Tensor, float]]) -> None:
    """Add each value to its block (in the tensor's opmath: float for bf16, rounded once)."""
    with torch.no_grad():
        for view, value in views:
            view.add_(value)
