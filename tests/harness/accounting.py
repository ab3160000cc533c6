"""The byte accounting of a plan computed again from its expanded ops (`plan.ops`), as an oracle for the factored
accounting every Plan computes (planner.accounting.account_program)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from reshard.planner.accounting import Accounting, Bounds


def _pairs(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> tuple[tuple[int, int, int], ...]:
    """(src, dst, bytes) summed per pair, sorted by (src, dst); every entry moves at least one byte."""
    sums: dict[tuple[int, int], int] = {}
    for s, d, b in zip(src.tolist(), dst.tolist(), nbytes.tolist()):
        sums[(s, d)] = sums.get((s, d), 0) + b
    return tuple((s, d, b) for (s, d), b in sorted(sums.items()) if b)


def account(ops: dict[str, np.ndarray], itemsize: int, num_src: int, num_dst: int,
            colocation: Sequence[int] | None, bounds: Bounds, ranks_per_replica: int | None = None) -> Accounting:
    """The Accounting of expanded `ops`. colocation: per destination rank, the source rank on its device (None:
    not colocated); ranks_per_replica: tells EPLB slot copies (relays inside one replica) from fan-out relays
    (None: one replica)."""
    colocation = None if colocation is None else np.asarray(colocation, dtype=np.int64)
    nbytes = ops["rows"] * ops["cols"] * itemsize
    src, dst, relay = ops["src_rank"], ops["dst_rank"], ops["src_side"] == 1
    on_rank = relay & (src == dst)  # fan-out relays go to other replicas, never to their own rank
    copy = on_rank | (relay & (src // ranks_per_replica == dst // ranks_per_replica)) if ranks_per_replica else on_rank
    local = (src == colocation[dst]) & ~relay if colocation is not None else np.zeros(len(src), dtype=bool)
    sent = ~local & ~relay
    total, local_bytes, model = int(nbytes.sum()), int(nbytes[local].sum()), bounds.model_bytes
    return Accounting(
        total_bytes=total, cross_bytes=total - local_bytes, local_bytes=local_bytes,
        lower_bound_bytes=int(sum(bounds.lower_bound_by_dst)),
        gather_broadcast_bytes=(model - bounds.gatherer_held_bytes) + model * num_dst, model_bytes=model,
        num_ops=int(len(src)),
        num_transfers=len(np.unique(np.stack([ops["stage"], ops["src_side"], src, dst]), axis=1)[0]) if len(src) else 0,
        egress_bytes=tuple(np.bincount(src[sent], weights=nbytes[sent], minlength=num_src).astype(np.int64).tolist()),
        ingress_bytes=tuple(np.bincount(dst, weights=nbytes, minlength=num_dst).astype(np.int64).tolist()),
        relay_egress_bytes=tuple(np.bincount(src[relay], weights=nbytes[relay], minlength=num_dst)
                                 .astype(np.int64).tolist()),
        lower_bound_by_dst=tuple(bounds.lower_bound_by_dst),
        pair_bytes=_pairs(src[~relay], dst[~relay], nbytes[~relay]),
        relay_pair_bytes=_pairs(src[relay], dst[relay], nbytes[relay]),
        num_stages=int(ops["stage"].max()) + 1 if len(src) else 0,
        egress_lower_bound=bounds.egress_lower_bound, egress_unit_max=bounds.egress_unit_max,
        holder_sets_laminar=bounds.holder_sets_laminar,
        slot_copy_bytes=int(nbytes[copy].sum()), slot_copy_local_bytes=int(nbytes[on_rank].sum()))
