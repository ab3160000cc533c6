"""What a plan covers and in which units: the selected canonical tensors, and each tensor's width in units of the
model's dtype (a float32 tensor of a bfloat16 model is planned as twice as many bfloat16 units). The compiler
and the saved-plan verifier (planner.verify) both use them."""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable

import numpy as np

from ..errors import PlanError
from ..layouts import Layout, ModelSpec
from ..layouts.base import PlacementTable
from ..layouts.model import DTYPE_SIZES


def select_indices(model: ModelSpec, tensors: Iterable[str] | None, layers: Iterable[int] | None) -> np.ndarray:
    """Canonical indices of the selection, ascending."""
    c = model.canonical
    chosen = np.ones(len(c), dtype=bool)
    if tensors is not None:
        index = {t.name: t.index for t in model.tensors}
        unknown = sorted(set(tensors) - set(index))
        if unknown:
            raise PlanError("unknown tensor names in the selection", unknown)
        chosen &= np.isin(np.arange(len(c)), [index[n] for n in set(tensors)])
    if layers is not None:
        wanted_layers = sorted(set(layers))
        bad = [x for x in wanted_layers if not 0 <= x < model.num_layers]
        if bad:
            raise PlanError(f"layers {bad} are outside [0, {model.num_layers})")
        chosen &= np.isin(c.layer, wanted_layers)
    index = np.flatnonzero(chosen)
    if not len(index):
        raise PlanError("the selection is empty")
    return index


def unit_ratios(model: ModelSpec) -> tuple[np.ndarray, np.ndarray, dict[int, str]]:
    """Per canonical tensor, how many units of the model's dtype one of its elements takes, as num / den (1 / 1
    for almost all; 2 / 1 for a float32 tensor of a bfloat16 model; 1 / 2 for a float8 tensor of one), and the own
    dtype of those that differ. A plan moves units: a tensor of another dtype is planned as its bytes seen in the
    model's dtype, so it travels bit-exact (a narrower one in pairs of elements, which its boxes must keep whole)."""
    num = np.ones(len(model.canonical), dtype=np.int64)
    den = np.ones(len(model.canonical), dtype=np.int64)
    own: dict[int, str] = {}
    for t in model.own_dtype_tensors:
        size = DTYPE_SIZES.get(t.dtype)
        if size is None or (size % model.itemsize and model.itemsize % size):
            raise PlanError(f"{t.name} is kept in {t.dtype}, which is not a whole number of the model's "
                            f"{model.dtype} units, nor a whole fraction of one")
        num[t.index], den[t.index], own[t.index] = max(size // model.itemsize, 1), \
            max(model.itemsize // size, 1), t.dtype
    return num, den, own


def unit_placements(src: Layout, dst: Layout,
                    sel: np.ndarray) -> tuple[PlacementTable, tuple[str, ...], PlacementTable, tuple[str, ...]]:
    """The selection's placements in units (`in_units`), each with its kinds' dtypes: the source's on every rank,
    then destination replica 0's."""
    ratios = unit_ratios(src.model)
    return (*in_units(src.placement_table(sel), *ratios, "source"),
            *in_units(dst.placement_table(sel, replica=0), *ratios, "destination"))


def data_rows(t: PlacementTable) -> PlacementTable:
    """The rows of `t` that place any data."""
    keep = t.n0 * t.n1 > 0
    return replace(t, **{c: getattr(t, c)[keep] for c in PlacementTable.COLUMNS})


def bound_facts(model: ModelSpec, sel: np.ndarray, D: PlacementTable, ranks_per_replica: int,
                num_replicas: int) -> tuple[tuple[int, ...], int]:
    """(bytes of model data per destination rank, bytes of the selected model), from replica 0's placements with
    data `D`: the figures of `Bounds` that a loaded plan must match."""
    num, den, _ = unit_ratios(model)
    per_dst0 = np.bincount(D.rank, weights=D.n0 * D.n1, minlength=ranks_per_replica).astype(np.int64)
    return (tuple((np.tile(per_dst0, num_replicas) * model.itemsize).tolist()),
            int((model.canonical.numel * num // den)[sel].sum()) * model.itemsize)


def in_units(t: PlacementTable, num: np.ndarray, den: np.ndarray, own: dict[int, str], side: str
              ) -> tuple[PlacementTable, tuple[str, ...]]:
    """The placements with other dtypes' columns, origins and row strides counted in units; the dtype of each
    physical tensor kind ("" = the model's). A narrower dtype's boxes must hold whole units (even columns)."""
    r, q = num[t.canon], den[t.canon]
    wide = np.flatnonzero((r > 1) | (q > 1))
    if not len(wide):
        return t, ()
    data = t.n0 * t.n1 > 0
    t = _split_kinds(t, r, q, data)  # one name in two dtypes on different ranks (local layer names under PP)
    dtypes = [""] * len(t.kinds)
    scale = np.ones(len(t.kinds), dtype=np.int64)
    shrink = np.ones(len(t.kinds), dtype=np.int64)
    for k, c in zip(t.kind[wide].tolist(), t.canon[wide].tolist()):
        dtypes[k], scale[k], shrink[k] = own[c], num[c], den[c]
    mixed = np.flatnonzero(((r != scale[t.kind]) | (q != shrink[t.kind])) & data)
    if len(mixed):
        name = t.kinds[int(t.kind[mixed[0]])][0]
        raise PlanError(f"{side} layout puts data of two dtypes into one tensor {name!r}")
    split = np.flatnonzero(data & (q > 1) & ((t.c1 % q != 0) | (t.n1 % q != 0) | (t.origin % q != 0)
                                             | (t.stride % q != 0)))
    if len(split):
        i = int(split[0])
        raise PlanError(f"{side} layout: a box of {t.kinds[int(t.kind[i])][0]!r} (columns {int(t.c1[i])}.."
                        f"{int(t.c1[i] + t.n1[i])}, row stride {int(t.stride[i])}) splits a pair of "
                        f"{own[int(t.canon[i])]} elements that travel as one unit")
    kinds = tuple((n, (*shape[:-1], shape[-1] * f // d)) for (n, shape), f, d in
                  zip(t.kinds, scale.tolist(), shrink.tolist()))
    return replace(t, kinds=kinds, **{c: getattr(t, c) * r // q for c in ("c1", "n1", "origin", "stride")}), \
        tuple(dtypes)


def _split_kinds(t: PlacementTable, r: np.ndarray, q: np.ndarray, data: np.ndarray) -> PlacementTable:
    """Kinds (name, shape) whose data rows come in several dtypes -- on different ranks: Megatron names layers
    per stage, so layer 0 of stage 0 and layer k of stage 1 share a name, and an FP8 destination may quantize one
    and not the other -- become one kind per dtype. Two dtypes in one rank's tensor stay an error (below)."""
    code = r * 8 + q  # ratios are small: num in {1, 2, 4}, den in {1, 2, 4}
    rows = np.flatnonzero(data)
    pairs = np.unique(np.stack([t.kind[rows], code[rows]]), axis=1) if len(rows) else np.zeros((2, 0), np.int64)
    kinds_with = np.bincount(pairs[0], minlength=len(t.kinds)) if pairs.shape[1] else np.zeros(len(t.kinds), int)
    if not (kinds_with > 1).any():
        return t
    kinds, kind = list(t.kinds), t.kind.copy()
    for k in np.flatnonzero(kinds_with > 1).tolist():
        for c in pairs[1][pairs[0] == k].tolist()[1:]:  # the first dtype keeps the kind
            at = rows[(t.kind[rows] == k) & (code[rows] == c)]
            kind[at] = len(kinds)
            kinds.append(t.kinds[k])
    return replace(t, kind=kind, kinds=tuple(kinds))
