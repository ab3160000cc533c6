"""Fan-out forests over destination replicas: the source feeds a few *root* replicas, the others receive the same
bytes from other replicas (relay ops, `src_side == 1`), rank r of the parent forwarding to rank r of the child.

Split trees: each destination rank's bytes are cut into P = ceil(fanout / relay_cap) equal *parts*, part j along
its own tree. In every tree each root has one child and every other replica at most `fanout`, laid breadth first
over the non-roots rotated by j blocks, so the trees' interiors are disjoint: no destination rank sends more than
`relay_cap` times what it receives, the trainer sends `roots` copies of the model, and depth grows with the log
of the replica count (NCCL's double binary trees are fanout 2, relay_cap 1). If the interiors cannot be disjoint,
fanout is lowered until they are. Recorded as `parent[j, k]` and `stage[j, k]` (stage = depth).

Within one replica, an EPLB engine's redundant expert slots are fed by the engine (`slot_copies`): the trainer
sends each expert once, into the rank holding most of its slots, and every other slot copies it from there in a
stage after every other. Copies are relays, so only plans compiled with `fanout` get them.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..arrays import unique_inverse
from ..errors import PlanError
from .merge import run_rects


def _interior(non_roots: int, roots: int, fanout: int) -> int:
    """Replicas with children among the non-roots of one tree (breadth first: the first ones)."""
    return -(-(non_roots - roots) // fanout) if non_roots > roots else 0


def forest_shape(num_replicas: int, roots: int, fanout: int, relay_cap: int) -> tuple[int, int]:
    """(fanout, parts) actually used: parts = ceil(fanout / relay_cap), fanout lowered until the trees'
    interiors are disjoint."""
    n = num_replicas - roots
    while fanout > 1:
        parts = -(-fanout // relay_cap)
        if parts * _interior(n, roots, fanout) <= n:
            return fanout, parts
        fanout -= 1
    return 1, 1


def replica_forests(num_replicas: int, fanout: int | None, roots: int,
                    relay_cap: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(parent, stage), each (parts, replicas): parent -1 for roots, stage = depth in that part's tree."""
    if not fanout:
        roots = num_replicas
    if not 1 <= roots <= num_replicas:
        raise PlanError(f"roots={roots} must be between 1 and the {num_replicas} destination replicas")
    if roots == num_replicas:
        return np.full((1, num_replicas), -1, dtype=np.int64), np.zeros((1, num_replicas), dtype=np.int64)
    fanout, parts = forest_shape(num_replicas, roots, fanout, relay_cap)
    block = _interior(num_replicas - roots, roots, fanout)
    parent = np.full((parts, num_replicas), -1, dtype=np.int64)
    stage = np.zeros((parts, num_replicas), dtype=np.int64)
    order = np.arange(roots, num_replicas)
    for j in range(parts):  # roots 0..roots-1, each with one head; the rotated non-roots hang breadth first below
        rotated = np.roll(order, -(j * block % len(order))).tolist()
        for i, k in enumerate(rotated):  # a parent comes before its children, so its stage is known
            parent[j, k] = i if i < roots else rotated[(i - roots) // fanout]
            stage[j, k] = stage[j, parent[j, k]] + 1
    return parent, stage


def check_forest(parent: np.ndarray, stage: np.ndarray) -> list[str]:
    """Problems with recorded forests, both (parts, replicas) (program.check_program checks the shapes): in every
    part, each relayed replica's parent receives that part in an earlier stage; the roots are the same in every
    part and receive in stage 0."""
    problems = []
    roots = parent[0] < 0
    for j in range(parent.shape[0]):
        if not np.array_equal(parent[j] < 0, roots):
            problems.append(f"part {j} has different roots than part 0")
        for k, (p, s) in enumerate(zip(parent[j].tolist(), stage[j].tolist())):
            if p < 0 and s != 0:
                problems.append(f"replica {k} is fed by the source but receives in stage {s}")
            if p >= 0 and not (0 <= p < parent.shape[1] and stage[j, p] < s):
                problems.append(f"part {j} of replica {k} is relayed from replica {p}, which does not hold it "
                                f"before stage {s}")
    return problems[:20]


def slot_copies(ops: dict[str, np.ndarray], expert_of: np.ndarray) -> tuple[dict[str, np.ndarray],
                                                                        dict[str, np.ndarray]]:
    """Split one replica's unmerged ops into those the source feeds and the redundant expert slots' copies
    (program.COPY_COLUMNS): ops of a routed expert (`expert_of[canon] >= 0`) reading the same source region write
    replicas of one expert. Of each such set, the op on the rank holding most of it (then the lowest rank, tensor
    and offset) stays fed; every other becomes a copy from its region."""
    from .program import COPY_COLUMNS

    idx = np.flatnonzero(expert_of[ops["canon"]] >= 0)
    empty = {c: np.zeros(0, np.int64) for c in COPY_COLUMNS}
    if not len(idx):
        return ops, empty
    col = {c: ops[c][idx] for c in ("canon", "box", "src_d0", "src_d1", "rows", "cols", "dst_rank", "dst_tensor",
                                    "dst_offset", "dst_stride")}
    first, same = unique_inverse(tuple(col[c] for c in ("canon", "box", "src_d0", "src_d1", "rows", "cols")))
    if len(first) == len(idx):  # no expert in two slots
        return ops, empty
    at = unique_inverse((same, col["dst_rank"]))[1]  # (set, rank) pair of each op
    # per set: on the rank holding most of its ops, then the lowest rank, tensor and offset
    order = np.lexsort((col["dst_offset"], col["dst_tensor"], col["dst_rank"], -np.bincount(at)[at], same))
    kept = order[np.flatnonzero(np.diff(np.concatenate([[-1], same[order]])))]
    primary = np.empty(len(first), np.int64)
    primary[same[kept]] = kept
    copy = np.ones(len(idx), bool)
    copy[kept] = False
    c, f = np.flatnonzero(copy), primary[same[copy]]
    copies = {"canon": col["canon"][c], "rows": col["rows"][c], "cols": col["cols"][c],
              "src_rank": col["dst_rank"][f], "src_tensor": col["dst_tensor"][f], "src_offset": col["dst_offset"][f],
              "src_stride": col["dst_stride"][f], "dst_rank": col["dst_rank"][c], "dst_tensor": col["dst_tensor"][c],
              "dst_offset": col["dst_offset"][c], "dst_stride": col["dst_stride"][c]}
    keep = np.ones(len(ops["canon"]), bool)
    keep[idx[c]] = False
    return {k: v[keep] for k, v in ops.items()}, copies


def slot_copy_problems(copies: dict[str, np.ndarray], d_tid: np.ndarray, D: Any) -> list[str]:
    """At most ten problems with slot copies (program.COPY_COLUMNS), given replica 0's destination placements with
    data `D` (a PlacementTable) and their table ids `d_tid`: each copy must read a block holding the same canonical
    elements as the block it writes (each end inside one placement, on its rows), and none may read what a copy
    writes (they run in one stage)."""
    if not len(copies["rows"]):
        return []
    origin, stride, n0, n1, canon, c0, c1 = D.origin, D.stride, D.n0, D.n1, D.canon, D.c0, D.c1
    order = np.lexsort((origin, d_tid))
    t_s, o_s = d_tid[order], origin[order]
    at: dict[str, tuple[np.ndarray, ...]] = {}
    for end in ("src", "dst"):
        t, off, st = copies[f"{end}_tensor"], copies[f"{end}_offset"], copies[f"{end}_stride"]
        i = np.maximum(np.searchsorted(t_s * (1 << 40) + o_s, t * (1 << 40) + off, side="right") - 1, 0)
        row = order[i]
        rel = off - origin[row]
        r, c = rel // np.maximum(stride[row], 1), rel % np.maximum(stride[row], 1)
        inside = ((d_tid[row] == t) & (rel >= 0) & (r + copies["rows"] <= n0[row]) & (c + copies["cols"] <= n1[row])
                  & ((copies["rows"] == 1) | (st == stride[row])))
        at[end] = (inside, canon[row], c0[row] + r, c1[row] + c)
    (si, sk, sr, sc), (di, dk, dr, dc) = at["src"], at["dst"]
    wrong = np.flatnonzero(~si | ~di | (sk != dk) | (sr != dr) | (sc != dc) | (copies["canon"] != dk))
    problems = [f"slot copy {i} into tensor {copies['dst_tensor'][i]} at {copies['dst_offset'][i]} does not read "
                f"the same expert's elements from tensor {copies['src_tensor'][i]} at {copies['src_offset'][i]}"
                for i in wrong[:10].tolist()]
    span = lambda e: (copies["rows"] - 1) * copies[f"{e}_stride"] + copies["cols"]  # noqa: E731
    w_key = copies["dst_tensor"] * (1 << 40) + copies["dst_offset"]
    w_order = np.argsort(w_key, kind="stable")
    w_start, w_end = w_key[w_order], w_key[w_order] + span("dst")[w_order]
    r_start = copies["src_tensor"] * (1 << 40) + copies["src_offset"]
    r_end = r_start + span("src")
    j = np.searchsorted(w_start, r_end, side="left") - 1  # the last write starting before the read ends
    hit = (j >= 0) & (w_end[np.maximum(j, 0)] > r_start)
    problems += [f"slot copy {i} reads tensor {copies['src_tensor'][i]} at {copies['src_offset'][i]}, which a slot "
                 f"copy writes in the same stage" for i in np.flatnonzero(hit)[:10].tolist()]
    return problems[:10]


def split_parts(relay: dict[str, np.ndarray], parts: int, ranks_per_replica: int) -> dict[str, np.ndarray]:
    """Cut each destination position's relay ops into `parts` runs of equal element counts (the part boundaries
    fall at ceil(j * total / parts)); ops crossing a boundary are split (by rows, then elements). Adds "part"."""
    n = len(relay["rows"])
    if parts <= 1 or not n:
        return {**relay, "part": np.zeros(n, dtype=np.int64)}
    elems = relay["rows"] * relay["cols"]
    pos = relay["dst_rank"]  # ops are sorted by destination tensor, whose ids are grouped by rank
    total = np.bincount(pos, weights=elems, minlength=ranks_per_replica).astype(np.int64)
    first = np.searchsorted(pos, np.arange(ranks_per_replica))
    end = np.cumsum(elems)
    end = end - np.concatenate([[0], end])[first][pos]  # cumulative elements inside the position
    start = end - elems
    bounds = np.stack([-(-total * j // parts) for j in range(1, parts)], axis=1)  # (positions, parts - 1)
    part_of_start = (bounds[pos] <= start[:, None]).sum(axis=1)
    part_of_last = (bounds[pos] <= (end - 1)[:, None]).sum(axis=1)
    out = {**relay, "part": part_of_start}
    crossing = np.flatnonzero(part_of_last > part_of_start)
    if not len(crossing):
        return out
    keep = np.ones(n, dtype=bool)
    keep[crossing] = False
    pieces = []
    for i in crossing.tolist():
        cuts = [int(b - start[i]) for b in bounds[pos[i]].tolist() if start[i] < b < end[i]]
        op = {c: int(relay[c][i]) for c in relay}
        first_part = int(part_of_start[i])
        for k, (a, b) in enumerate(zip([0] + cuts, cuts + [int(elems[i])])):  # elements [a, b): at most 3 ops
            pieces += [{**op, "rows": nr, "cols": nc, "dst_offset": op["dst_offset"] + r * op["dst_stride"] + c,
                        "dst_stride": nc if nr == 1 else op["dst_stride"], "part": first_part + k}
                       for r, c, nr, nc in run_rects(a, b - a, op["cols"])]
    extra = {c: np.asarray([p[c] for p in pieces], dtype=np.int64) for c in out}
    return {c: np.concatenate([out[c][keep], extra[c]]) for c in out}


__all__ = ["check_forest", "forest_shape", "replica_forests", "slot_copies", "slot_copy_problems", "split_parts"]
