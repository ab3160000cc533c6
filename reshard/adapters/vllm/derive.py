"""Derive a vLLM model's destination layout from the model itself, by running its own weight loaders, and check it
against the declared layout before any byte moves (`check_layout`: every problem at once, in one
LayoutMismatchError; catches a stacking order or KV replication that differs while the shapes agree).

Every canonical element gets a unique marker, (tensor index + 1) * 2**32 + flat element index (exact in float64);
the probed parameters are swapped for float64 scratch filled with -1 and fed the marked tensors through
`model.load_weights`, so each scratch element says which canonical element landed there. The live parameters are
put back afterwards. Costs the probed layers once more in float64 on the host (`representative_layers` keeps it to
one layer of each kind).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from ...errors import LayoutMismatchError
from ...layouts import Layout, ModelSpec, Placement, TensorSpec, VllmLayout
from .live import config_scope, dtype_name, layer_of, weights

SHIFT = 1 << 32
UNWRITTEN = -1.0


@dataclass(frozen=True)
class DerivedLayout:
    """What one rank of a live vLLM model holds: its weights (name -> (shape, dtype)) and, for the probed
    canonical tensors, where its loaders put them: (canonical name, Placement) pairs."""

    rank: int
    tensors: dict[str, tuple[tuple[int, ...], str]]
    placements: tuple[tuple[str, Placement], ...] = ()
    probed: tuple[str, ...] = ()  # canonical tensors fed to the loaders
    problems: tuple[str, ...] = field(default=())  # landings that are not boxes, stray values


def representative_layers(spec: ModelSpec) -> tuple[int, ...]:
    """One layer of each kind (dense MLP, MoE), the first of each."""
    kinds: dict[bool, int] = {}
    for i in range(spec.num_layers):
        kinds.setdefault(spec.is_moe_layer(i), i)
    return tuple(sorted(kinds.values()))


def marker(t: TensorSpec) -> torch.Tensor:
    """A tensor of distinct values that tell tensor and element apart (what a probe feeds the loaders)."""
    return (torch.arange(t.numel, dtype=torch.float64) + float((t.index + 1) * SHIFT)).view(t.shape)


def probed_tensors(spec: ModelSpec, layers: Sequence[int] | None) -> list[TensorSpec]:
    """Canonical tensors of the given layers plus the ones outside layers (embeddings, final norm, lm_head)."""
    if layers is None:
        return list(spec.tensors)
    chosen = set(layers)
    return [t for t in spec.tensors if t.layer == -1 or t.layer in chosen]


def derive_layout(model: torch.nn.Module, spec: ModelSpec, rank: int, layers: Sequence[int] | None = None,
                  vllm_config: Any = None, params: dict[str, torch.nn.Parameter] | None = None) -> DerivedLayout:
    """Run the model's loaders on marked canonical tensors (of `layers`, default all) and read the layout off.

    Call it outside a weight-update session (the loaders must not be wrapped by a layerwise reload); needs
    vLLM's parallel state (TP rank) initialized, as in any worker. `params`: the model's `live.weights`, where
    the caller has read them already.
    """
    params = weights(model) if params is None else params
    tensors = {n: (tuple(p.shape), dtype_name(p.dtype)) for n, p in params.items()}
    chosen = probed_tensors(spec, layers)
    wanted_layers = {t.layer for t in chosen}
    swapped = {n: p for n, p in params.items() if layer_of(n) in wanted_layers}
    live = {n: p.data for n, p in swapped.items()}
    scratch = {n: torch.full(tuple(p.shape), UNWRITTEN, dtype=torch.float64) for n, p in swapped.items()}
    for name, p in swapped.items():
        p.data = scratch[name]
    try:
        feed = ((t.name, marker(t)) for t in chosen)  # made one at a time, as the loaders consume them
        with config_scope(vllm_config), torch.no_grad():
            model.load_weights(feed)
        placements, problems = [], []
        by_index = {t.index: t for t in spec.tensors}
        for name, values in scratch.items():
            p, q = _read_placements(rank, name, values, by_index)
            placements += p
            problems += q
    finally:
        for name, p in swapped.items():
            p.data = live[name]
    placements.sort(key=lambda cp: (cp[1].tensor, cp[0], cp[1].phys_offset))
    return DerivedLayout(rank, tensors, tuple(placements), tuple(t.name for t in chosen), tuple(problems))


def _read_placements(rank: int, name: str, values: torch.Tensor,
                     by_index: dict[int, TensorSpec]) -> tuple[list[tuple[str, Placement]], list[str]]:
    """Group the marked elements of one scratch tensor into boxes: one Placement per canonical tensor and
    leading (stack) index, or a problem naming what is not a box."""
    shape = tuple(values.shape)
    flat = values.reshape(-1).numpy()
    marked = flat >= SHIFT
    problems = []
    stray = ~marked & (flat != UNWRITTEN) & (flat != 0.0)
    if stray.any():
        problems.append(f"{name} on rank {rank}: {int(stray.sum())} elements hold values that are no canonical "
                        f"element (a loader transformed the data instead of copying it)")
    codes = flat[marked].astype(np.int64)
    positions = np.flatnonzero(marked)
    tids = (codes >> 32) - 1
    out: list[tuple[str, Placement]] = []
    for tid in np.unique(tids).tolist():
        t = by_index.get(tid)
        sel = tids == tid
        elem = codes[sel] & (SHIFT - 1)
        if t is None or int(elem.max()) >= t.numel:
            problems.append(f"{name} on rank {rank}: holds markers of no canonical tensor (id {tid})")
            continue
        phys = np.stack(np.unravel_index(positions[sel], shape))  # [ndim_phys, n]
        canon = np.stack(np.unravel_index(elem, t.shape))  # [ndim_canon, n]
        lead = len(shape) - len(t.shape)
        if lead < 0:
            problems.append(f"{name} on rank {rank}: {t.name} {t.shape} landed in a tensor of fewer dimensions")
            continue
        keys = phys[:lead].T  # the stack index of each element (no columns: one group)
        for key in np.unique(keys, axis=0):
            part = np.all(keys == key, axis=1)
            boxes = _as_boxes(canon[:, part], phys[lead:, part])
            if boxes is None:
                problems.append(f"{name} on rank {rank}: the elements of {t.name} (stack index {tuple(key)}) "
                                f"do not form boxes copied by translation")
                continue
            for lo, lengths, phys_lo in boxes:
                out.append((t.name, Placement(rank, name, shape, lo, lengths, tuple(int(k) for k in key) + phys_lo)))
    return out, problems


def _as_boxes(canon: np.ndarray, phys: np.ndarray) -> list[tuple] | None:
    """The elements as boxes, each moved by one translation: one box, or one per distinct translation (a rank's
    TP slices of the unequal parts of a fused stack sit side by side in its tensor); None if they are not."""
    deltas, which = np.unique((phys - canon).T, axis=0, return_inverse=True)
    boxes = [_as_box(canon[:, which.reshape(-1) == i], phys[:, which.reshape(-1) == i]) for i in range(len(deltas))]
    return None if any(b is None for b in boxes) else boxes


def _as_box(canon: np.ndarray, phys: np.ndarray) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """(canonical offset, lengths, physical offset) if the elements are a full box moved by one translation."""
    lo, hi = canon.min(axis=1), canon.max(axis=1)
    lengths, delta = hi - lo + 1, phys - canon
    if int(np.prod(lengths)) != canon.shape[1] or not np.all(delta == delta[:, :1]):
        return None
    return (tuple(int(x) for x in lo), tuple(int(x) for x in lengths), tuple(int(x) for x in lo + delta[:, 0]))


def declared_placements(layout: Any, rank: int, tensors: Iterable[TensorSpec]) -> list[tuple[str, Placement]]:
    """The declared layout's placements on `rank` for these canonical tensors (pure padding left out)."""
    replica = rank // layout.ranks_per_replica
    return sorted(((t.name, p) for t in tensors for p in layout.placements(t, replica=replica)
                   if p.rank == rank and 0 not in p.lengths), key=lambda cp: (cp[1].tensor, cp[0], cp[1].phys_offset))


def widens(plan_dtype: str, live_dtype: str) -> bool:
    """True if the engine keeps a tensor in a wider floating type than the plan moves it in (vLLM keeps some
    small tensors in float32, e.g. Qwen3.5's A_log or DeepSeek's router bias): every value the plan carries
    is exact there, so a direct install lands it in plan dtype and casts it up (DirectBinding.finish)."""
    plan, live = getattr(torch, plan_dtype, None), getattr(torch, live_dtype, None)
    return (isinstance(plan, torch.dtype) and isinstance(live, torch.dtype) and live.is_floating_point
            and plan.is_floating_point and plan != live and torch.promote_types(plan, live) == live)


def structure_problems(live: dict[str, tuple[tuple[int, ...], str]], layout: Layout, rank: int) -> list[str]:
    """What differs between the live rank's weights ({name: (shape, dtype)}) and what `layout` declares for `rank`."""
    declared = layout.rank_tensors(rank)
    problems = []
    for name in sorted(set(live) | set(declared)):
        want_dtype = layout.tensor_dtype(rank, name)  # DeepSeek's float32 router bias: its own
        if name not in live:
            problems.append(f"{name}: declared {tuple(declared[name])} {want_dtype}, but the live model has no "
                            f"such parameter")
        elif name not in declared:
            problems.append(f"{name}: the live model has {live[name][0]} {live[name][1]}, which the declared "
                            f"layout does not hold")
        elif tuple(live[name][0]) != tuple(declared[name]) or not (
                live[name][1] == want_dtype or widens(want_dtype, live[name][1])):
            problems.append(f"{name}: live {live[name][0]} {live[name][1]}, declared {tuple(declared[name])} "
                            f"{want_dtype}")
    return problems


def _fmt(p: Placement) -> str:
    box = ", ".join(f"{o}:{o + n}" for o, n in zip(p.canon_offset, p.lengths))
    return f"[{box}] at {p.tensor}{list(p.phys_offset)}"


def merged_boxes(boxes: set[Placement]) -> set[Placement]:
    """The same elements as fewest boxes: boxes that continue each other along one dimension, in the canonical
    tensor and in the physical one alike, become one (a fused stack declared as q, k and v parts that a loader
    writes as one run is the same placement)."""
    boxes, size = set(boxes), -1
    while size != len(boxes):  # until a whole pass merges nothing
        size = len(boxes)
        for d in range(max((len(p.lengths) for p in boxes), default=0)):
            groups: dict[tuple, list[Placement]] = defaultdict(list)
            for p in boxes:
                if len(p.lengths) > d:
                    rest = tuple(t[:d] + t[d + 1:] for t in (p.canon_offset, p.lengths, p.phys_offset))
                    groups[(p.rank, p.tensor, p.shape, rest)].append(p)
            for group in groups.values():
                group.sort(key=lambda p: p.canon_offset[d])
                run = group[0]
                for b in group[1:]:
                    n = run.lengths[d]
                    if run.canon_offset[d] + n == b.canon_offset[d] and run.phys_offset[d] + n == b.phys_offset[d]:
                        boxes -= {run, b}
                        run = run._replace(lengths=run.lengths[:d] + (n + b.lengths[d],) + run.lengths[d + 1:])
                        boxes.add(run)
                    else:
                        run = b
    return boxes


def placement_problems(derived: Sequence[tuple[str, Placement]], declared: Sequence[tuple[str, Placement]]) \
        -> list[str]:
    """What differs between where the loaders put each probed tensor (`derived`) and where the layout says
    (`declared`)."""
    def by_tensor(pairs: Sequence[tuple[str, Placement]]) -> dict[str, set[Placement]]:
        out: dict[str, set[Placement]] = defaultdict(set)
        for canon, p in pairs:
            out[canon].add(p)
        return defaultdict(set, {c: merged_boxes(ps) for c, ps in out.items()})

    got, want = by_tensor(derived), by_tensor(declared)
    problems = []
    for canon in sorted(set(got) | set(want)):
        if got[canon] != want[canon]:
            order = lambda ps: sorted(ps, key=lambda p: (p.tensor, p.phys_offset))  # noqa: E731
            problems.append(f"{canon}: declared {', '.join(map(_fmt, order(want[canon]))) or 'nowhere'}; "
                            f"vLLM's loaders put {', '.join(map(_fmt, order(got[canon]))) or 'nothing'}")
    return problems


def check_layout(model: torch.nn.Module, layout: Layout, rank: int, layers: Sequence[int] | None = None,
                 vllm_config: Any = None, params: dict[str, torch.nn.Parameter] | None = None) -> DerivedLayout:
    """Raise LayoutMismatchError unless rank `rank` of `layout` is what this live model holds and what its
    loaders write (for the canonical tensors of `layers`, default all). Returns the derived layout.
    `params`: the model's `live.weights`, where the caller has read them already."""
    where = f"rank {rank} of the live vLLM model ({type(model).__name__})"
    params = weights(model) if params is None else params
    live = {n: (tuple(p.shape), dtype_name(p.dtype)) for n, p in params.items()}
    problems = structure_problems(live, layout, rank)
    if problems:
        raise LayoutMismatchError(str(layout), problems, where=where)
    derived = derive_layout(model, layout.model, rank, layers, vllm_config, params)
    # vLLM's loaders write experts by its initial placement, whatever EPLB did since: the probe is compared with
    # that; the live placement is checked against the EPLB state (experts.check_placement)
    probe = layout.with_initial_experts() if isinstance(layout, VllmLayout) else layout
    declared = declared_placements(probe, rank, probed_tensors(layout.model, layers))
    problems = list(derived.problems) + placement_problems(derived.placements, declared)
    if problems:
        raise LayoutMismatchError(str(layout), problems, where=where)
    return derived
