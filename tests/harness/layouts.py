"""Reading layouts in tests: placement tables as rows to compare, Megatron ranks from grid coordinates, and an EPLB
placement's rows, slots and replica counts (what the package computes with, read back by hand)."""
from __future__ import annotations

import numpy as np

from reshard.layouts.base import PlacementTable
from reshard.layouts.expert_placement import ExpertPlacement, slot_index
from reshard.layouts.megatron import MegatronLayout


def table_rows(t: PlacementTable) -> list[tuple]:
    """(canon, rank, name, shape, c0, c1, n0, n1, origin, stride) per row: a form to compare tables by."""
    cols = [getattr(t, c).tolist() for c in t.COLUMNS]
    return [(c, r, t.kinds[k][0], t.kinds[k][1], *rest) for c, r, k, *rest in zip(*cols)]


def dense_rank(layout: MegatronLayout, tp: int, dp: int, pp: int) -> int:
    """The global rank at these coordinates of the dense layers' grid (inverse of `dense_coords`)."""
    s = layout.axis_strides(False)
    return tp * s["tp"] + dp * s["dp"] + pp * s["pp"]


def expert_rank(layout: MegatronLayout, etp: int, ep: int, edp: int, pp: int) -> int:
    """The global rank at these coordinates of the experts' grid (inverse of `expert_coords`)."""
    s = layout.axis_strides(True)
    return etp * s["tp"] + ep * s["ep"] + edp * s["dp"] + pp * s["pp"]


def placement_row(p: ExpertPlacement, moe_layer: int) -> tuple[int, ...]:
    """The placement of MoE layer `moe_layer` (counted over MoE layers only, as vLLM's EPLB counts them)."""
    return p.physical_to_logical[0 if p.num_rows == 1 else moe_layer]


def replica_counts(p: ExpertPlacement) -> np.ndarray:
    """[rows, E]: how many slots hold each logical expert (vLLM's `logical_replica_count`)."""
    return slot_index(p)[2]


def slots_of(p: ExpertPlacement, moe_layer: int, expert: int) -> tuple[int, ...]:
    """The physical slots holding logical expert `expert` in MoE layer `moe_layer`, ascending."""
    return tuple(int(s) for s in np.flatnonzero(np.asarray(placement_row(p, moe_layer)) == expert))
