"""Choosing among sources that hold the same bytes, so that the busiest sender moves as little as possible.

A *unit* is one group of template ops (a destination tensor and the source ranks holding its bytes) for one fed
replica, sent whole by one holder. Units with one holder are fixed; colocated plans take the holder on the
destination's device. The rest are placed one holder set at a time, smallest sets first: inside a set the units,
largest first, are laid along the holders' free room under the set's water level (the level that would equalize
their loads if units could be split).

Guarantee: when holder sets are laminar (disjoint or nested, as data- and tensor-parallel replication make them),
let LB be the largest, over holder sets S, of (bytes that must leave S: fixed units on S's ranks and units whose
holder set lies inside S) / |S|. No assignment beats LB, and the busiest sender here ends at most LB + w_max, w_max
the largest unit: when S is placed, its load comes only from sets inside it, so its water level is at most LB, and
a holder overshoots its room by less than one unit. Families that are not laminar get no guarantee, and LB is the
general bound from subset relations. The plan reports LB and w_max (`egress_lower_bound`, `egress_unit_max`).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .merge import run_positions


def _report(lower: int, unit_max: int, laminar: bool) -> dict[str, Any]:
    """The guarantee of `choose_holders`' assignment, as the Bounds entries that carry it: LB above, w_max (the
    largest unit placed by choice), and whether the holder sets were laminar (then busiest <= LB + w_max)."""
    return {"egress_lower_bound": int(lower), "egress_unit_max": int(unit_max), "holder_sets_laminar": laminar}


def _members(sets: np.ndarray, hset_start: np.ndarray, hset_count: np.ndarray, hset_ranks: np.ndarray):
    """(set position, rank) of every membership of the given holder sets."""
    cnt = hset_count[sets]
    return np.repeat(np.arange(len(sets)), cnt), hset_ranks[np.repeat(hset_start[sets], cnt) + run_positions(cnt)]


def laminar_parents(sets: np.ndarray, hset_start: np.ndarray, hset_count: np.ndarray,
                    hset_ranks: np.ndarray) -> tuple[bool, np.ndarray]:
    """Whether the sets (ordered by size) are laminar, and each one's smallest strict superset (-1: none).

    For every rank, list the sets holding it in (size, position) order; the family is laminar iff, for every set,
    all its ranks name the same next set (then that set contains it, and by induction any larger set meeting it).
    """
    owner, rank = _members(sets, hset_start, hset_count, hset_ranks)
    order = np.lexsort((owner, rank))  # by rank, then set position (= size order)
    o, r = owner[order], rank[order]
    nxt = np.full(len(o), -1, dtype=np.int64)
    same = r[1:] == r[:-1]
    nxt[:-1][same] = o[1:][same]
    lo = np.full(len(sets), np.iinfo(np.int64).max)
    hi = np.full(len(sets), -2, dtype=np.int64)
    np.minimum.at(lo, o, nxt)
    np.maximum.at(hi, o, nxt)
    return bool((lo == hi).all()), hi


def _water_levels(loads: np.ndarray, total: np.ndarray) -> np.ndarray:
    """Per row of `loads` (m x n): T with sum(max(0, T - loads)) == total."""
    srt = np.sort(loads.astype(np.float64), axis=1)
    k = np.arange(1, loads.shape[1] + 1)
    level = (total[:, None] + np.cumsum(srt, axis=1)) / k
    ok = np.concatenate([level[:, :-1] <= srt[:, 1:], np.ones((len(srt), 1), dtype=bool)], axis=1)
    return level[np.arange(len(srt)), np.argmax(ok, axis=1)]


def _place(loads: np.ndarray, ranks: np.ndarray, unit_row: np.ndarray, unit_w: np.ndarray) -> np.ndarray:
    """Positions (in each row of `ranks`, m x n) of units laid along their row's room under the water level.

    Units are given grouped by row, largest first inside a row. Rows must hold disjoint ranks."""
    m, n = ranks.shape
    total = np.bincount(unit_row, weights=unit_w, minlength=m)
    # rounded up: rooms that hold all of `total` (rounded down, a fractional level left rooms short and the
    # units past them all landed on the row's last rank)
    room = np.ceil(np.maximum(_water_levels(loads[ranks], total)[:, None] - loads[ranks] - 1e-9, 0)).astype(np.int64)
    big = int(max(room.sum(axis=1).max(initial=0), total.max(initial=0))) + 1
    ends = (np.cumsum(room, axis=1) + (np.arange(m) * big)[:, None]).ravel()
    begin = np.cumsum(unit_w) - unit_w
    row_start = np.searchsorted(unit_row, np.arange(m))
    begin = begin - begin[np.minimum(row_start, len(begin) - 1)][unit_row] + unit_row * big
    pos = np.searchsorted(ends, begin, side="right") - unit_row * n
    return np.clip(pos, 0, n - 1)


def choose_holders(group_bytes: np.ndarray, group_hset: np.ndarray, group_dst: np.ndarray,
                   hset_start: np.ndarray, hset_count: np.ndarray, hset_ranks: np.ndarray,
                   fed: np.ndarray, ranks_per_replica: int, num_src: int,
                   colocation: np.ndarray | None) -> tuple[np.ndarray, dict[str, Any]]:
    """(R, G) holder position per fed replica and group, and the guarantee (`_report`).

    group_dst: each group's destination rank in replica 0; hset_ranks[hset_start[s]: + hset_count[s]] are the
    ranks of holder set s in position order (ascending). colocation: per destination rank, the source rank on
    its device (None: not colocated).
    """
    R, G = len(fed), len(group_bytes)
    choice = np.zeros((R, G), dtype=np.int64)
    if not G:
        return choice, _report(0, 0, True)
    multi = hset_count[group_hset] > 1
    g_order = np.lexsort((np.arange(G), -group_bytes, group_hset, hset_count[group_hset]))
    local = np.zeros((R, G), dtype=bool)
    if colocation is not None:  # a holder on the destination's own device: a local copy
        mate = colocation[group_dst[None, :] + fed[:, None] * ranks_per_replica]  # source rank on its device
        hs = np.broadcast_to(group_hset[None, :], (R, G))
        key_base = int(max(num_src, int(mate.max()) + 1))
        keys = np.repeat(np.arange(len(hset_count)), hset_count) * key_base + hset_ranks
        probe = hs * key_base + mate
        at = np.clip(np.searchsorted(keys, probe), 0, len(keys) - 1)
        local = keys[at] == probe
        choice[local] = (at - hset_start[hs])[local]
    free = multi[None, :] & ~local
    fixed_g = np.bincount(np.nonzero(~free & ~local)[1], minlength=G)  # fixed units per group
    # Units in placing order: smallest holder sets first; inside a set, largest units first (ties by group, then
    # replica). Sort the groups once, then take each group's units replica by replica.
    fg = np.repeat(g_order, R)
    fr = np.tile(np.arange(R), G)
    keep = free[fr, fg]
    fr, fg = fr[keep], fg[keep]
    fixed = np.bincount(hset_ranks[hset_start[group_hset]], weights=group_bytes * fixed_g,
                        minlength=num_src).astype(np.int64)
    if not len(fg):
        return choice, _report(fixed.max(initial=0), 0, True)
    w = group_bytes[fg]
    unit_set = group_hset[fg]
    first = np.flatnonzero(np.concatenate([[True], unit_set[1:] != unit_set[:-1]]))
    sets = unit_set[first]  # in placing order (size, id)
    set_of_unit = np.cumsum(np.concatenate([[False], unit_set[1:] != unit_set[:-1]]))
    set_bytes = np.bincount(set_of_unit, weights=w, minlength=len(sets)).astype(np.int64)
    laminar, parent = laminar_parents(sets, hset_start, hset_count, hset_ranks)
    sizes = hset_count[sets]
    if laminar:  # sets of one size are disjoint (and adjacent in placing order): place them together
        lower = _laminar_bound(sets, parent, set_bytes, fixed, hset_start, hset_count, hset_ranks)
        batches = [np.flatnonzero(sizes == n) for n in np.unique(sizes).tolist()]
    else:
        lower = _general_bound(sets, set_bytes, fixed, hset_start, hset_count, hset_ranks)
        batches = [np.asarray([k]) for k in range(len(sets))]
    loads = fixed.copy()
    for rows in batches:
        ranks = hset_ranks[hset_start[sets[rows]][:, None] + np.arange(sizes[rows[0]])[None, :]]
        sel = np.flatnonzero((set_of_unit >= rows[0]) & (set_of_unit <= rows[-1]))
        row = set_of_unit[sel] - rows[0]
        pos = _place(loads, ranks, row, w[sel])
        choice[fr[sel], fg[sel]] = pos
        loads += np.bincount(ranks[row, pos], weights=w[sel], minlength=num_src).astype(np.int64)
    return choice, _report(lower, w.max(), laminar)


def _laminar_bound(sets, parent, set_bytes, fixed_loads, hset_start, hset_count, hset_ranks) -> int:
    """max over sets S of (fixed bytes on S + bytes of the units of every set inside S) / |S|."""
    inside = set_bytes.astype(np.float64)
    for k in range(len(sets)):  # sets are in size order, a parent is larger: children are summed first
        if parent[k] >= 0:
            inside[parent[k]] += inside[k]
    owner, rank = _members(sets, hset_start, hset_count, hset_ranks)
    fixed = np.bincount(owner, weights=fixed_loads[rank], minlength=len(sets))
    per_set = (inside + fixed) / hset_count[sets]
    return int(np.ceil(max(per_set.max(initial=0), float(fixed_loads.max(initial=0)))))


def _general_bound(sets, set_bytes, loads_fixed, hset_start, hset_count, hset_ranks) -> int:
    """The same bound for any family: subset relations computed set by set."""
    members = [frozenset(hset_ranks[hset_start[s]: hset_start[s] + hset_count[s]].tolist()) for s in sets.tolist()]
    best = float(loads_fixed.max(initial=0))
    for a, ma in enumerate(members):
        inside = sum(float(set_bytes[b]) for b, mb in enumerate(members) if mb <= ma)
        best = max(best, (inside + float(loads_fixed[list(ma)].sum())) / len(ma))
    return int(np.ceil(best))
