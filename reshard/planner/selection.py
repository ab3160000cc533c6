"""What a plan covers and in which units: the selected canonical tensors, and each tensor's width in units of the
model's dtype (a float32 tensor of a bfloat16 model is planned as twice as many bfloat16 units). The compiler
and the saved-plan verifier (planner.verify) both use them."""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable

import numpy as np

from ..errors import PlanError
from ..layouts import ModelSpec
from ..layouts.base import PlacementTable
from ..layouts.model import DTYPE_SIZES


def select_indices(model: ModelSpec, tensors: Iterable[str] | None, layers: Iterable[int] | None) -> np.ndarray:
    """Canonical indices of the selection, ascending."""
    c = model.canonical
    chosen = np.ones(len(c), dtype=bool)
    if tensors is not None:
        names = set(tensors)
        unknown, wanted = [], []
        for n in sorted(names):
            try:
                wanted.append(model.tensor(n).index)
            except KeyError:
                unknown.append(n)
        if unknown:
            raise PlanError("unknown tensor names in the selection", unknown)
        mask = np.zeros(len(c), dtype=bool)
        mask[wanted] = True
        chosen &= mask
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


def unit_ratios(model: ModelSpec) -> tuple[np.ndarray, dict[int, str]]:
    """Per canonical tensor, how many units of the model's dtype one of its elements takes (1 for almost all;
    2 for a float32 tensor of a bfloat16 model), and the own dtype of those that differ. A plan moves units:
    a wider tensor is planned as its bytes seen in the model's dtype, so it travels bit-exact."""
    ratio = np.ones(len(model.canonical), dtype=np.int64)
    own: dict[int, str] = {}
    for t in model.own_dtype_tensors:
        size = DTYPE_SIZES.get(t.dtype)
        if size is None or size % model.itemsize:
            raise PlanError(f"{t.name} is kept in {t.dtype}, which is not a whole number of the model's "
                            f"{model.dtype} units: plans move tensors at least as wide as the model's dtype")
        ratio[t.index], own[t.index] = size // model.itemsize, t.dtype
    return ratio, own


def in_units(t: PlacementTable, ratio: np.ndarray, own: dict[int, str], side: str
              ) -> tuple[PlacementTable, tuple[str, ...]]:
    """The placements with wider tensors' columns, origins and row strides counted in units; the dtype of
    each physical tensor kind ("" = the model's)."""
    r = ratio[t.canon]
    wide = np.flatnonzero(r > 1)
    if not len(wide):
        return t, ()
    dtypes = [""] * len(t.kinds)
    scale = np.ones(len(t.kinds), dtype=np.int64)
    for k, c in zip(t.kind[wide].tolist(), t.canon[wide].tolist()):
        dtypes[k], scale[k] = own[c], ratio[c]
    mixed = np.flatnonzero((r != scale[t.kind]) & (t.n0 * t.n1 > 0))
    if len(mixed):
        name = t.kinds[int(t.kind[mixed[0]])][0]
        raise PlanError(f"{side} layout puts data of two dtypes into one tensor {name!r}")
    kinds = tuple((n, (*shape[:-1], shape[-1] * f)) for (n, shape), f in zip(t.kinds, scale.tolist()))
    return replace(t, kinds=kinds, **{c: getattr(t, c) * r for c in ("c1", "n1", "origin", "stride")}), \
        tuple(dtypes)
