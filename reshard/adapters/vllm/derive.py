"""Derive a vLLM model's destination layout from the model itself, by running its own weight loaders.

Every canonical element gets a unique marker, (tensor index + 1) * 2**32 + flat element index (exact in float64);
the probed parameters are swapped for float64 scratch filled with -1 and fed the marked tensors through
`model.load_weights`, so each scratch element says which canonical element landed there. The live parameters are
put back afterwards. Costs the probed layers once more in float64 on the host (`representative_layers` keeps it to
one layer of each kind).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from ...layouts import ModelSpec, Placement, TensorSpec
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
    scratch, live = _swap_in_scratch(swapped)
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


def _swap_in_scratch(params: dict[str, torch.nn.Parameter]) -> tuple[dict[str, torch.Tensor],
                                                                       dict[str, torch.Tensor]]:
    """Point each parameter at a float64 host tensor filled with UNWRITTEN; return (scratch, live storage)."""
    scratch, live = {}, {}
    for name, p in params.items():
        live[name] = p.data
        scratch[name] = torch.full(tuple(p.shape), UNWRITTEN, dtype=torch.float64)
        p.data = scratch[name]
    return scratch, live


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
        keys = phys[:lead].T if lead else np.zeros((phys.shape[1], 0), dtype=np.int64)
        for key in np.unique(keys, axis=0):
            part = np.all(keys == key, axis=1) if lead else np.ones(phys.shape[1], dtype=bool)
            boxes = _as_boxes(canon[:, part], phys[lead:, part])
            if boxes is None:
                problems.append(f"{name} on rank {rank}: the elements of {t.name} (stack index {tuple(key)}) "
                                f"do not form boxes copied by translation")
                continue
            for lo, lengths, phys_lo in boxes:
                out.append((t.name, Placement(rank, name, shape, lo, lengths,
                                              tuple(int(k) for k in key) + phys_lo)))
    return out, problems


def _as_boxes(canon: np.ndarray, phys: np.ndarray) -> list[tuple] | None:
    """The elements as boxes, each moved by one translation: one box, or one per distinct translation (a rank's
    TP slices of the unequal parts of a fused stack sit side by side in its tensor); None if they are not."""
    box = _as_box(canon, phys)
    if box is not None:
        return [box]
    deltas, which = np.unique((phys - canon).T, axis=0, return_inverse=True)
    boxes = [_as_box(canon[:, which.reshape(-1) == i], phys[:, which.reshape(-1) == i]) for i in range(len(deltas))]
    return None if any(b is None for b in boxes) else boxes


def _as_box(canon: np.ndarray, phys: np.ndarray) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """(canonical offset, lengths, physical offset) if the elements are a full box moved by one translation."""
    lo, hi = canon.min(axis=1), canon.max(axis=1)
    lengths = hi - lo + 1
    if int(np.prod(lengths)) != canon.shape[1]:
        return None
    delta = phys - canon
    if not np.all(delta == delta[:, :1]):
        return None
    return (tuple(int(x) for x in lo), tuple(int(x) for x in lengths),
            tuple(int(x) for x in lo + delta[:, 0]))


def declared_placements(layout: Any, rank: int, tensors: Iterable[TensorSpec]) -> list[tuple[str, Placement]]:
    """The declared layout's placements on `rank` for these canonical tensors (pure padding left out)."""
    replica = rank // layout.ranks_per_replica
    out = []
    for t in tensors:
        for p in layout.placements(t, replica=replica):
            if p.rank == rank and 0 not in p.lengths:
                out.append((t.name, p))
    out.sort(key=lambda cp: (cp[1].tensor, cp[0], cp[1].phys_offset))
    return out
