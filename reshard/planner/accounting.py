"""Byte accounting of a plan, beside the lower bound and the gather-then-broadcast pattern.

- total_bytes: bytes all ops move (local copies included);
- cross_bytes / local_bytes: bytes that cross devices vs. same-device copies (only colocated plans have local);
- lower_bound_bytes: what the destinations must receive at least: each destination rank's share of model data
  (its placements' bytes, padding excluded); a plan that writes every element exactly once meets it;
- gather_broadcast_bytes: what the common RL-stack refit moves for the same model: gather every tensor whole
  onto one trainer rank (model bytes minus what that rank already holds), then broadcast the whole model to
  every destination rank (model bytes x destination ranks), where each rank keeps its shard;
- slot_copy_bytes: of the relayed bytes, what an EPLB engine's redundant expert slots copy from the expert's first
  slot in their engine (planner.fanout.slot_copies) instead of the trainer sending it again; slot_copy_local_bytes
  the part a rank copies from itself (a relay that never leaves the device);
- egress balance: the busiest trainer sender beside `egress_lower_bound`, a bound no choice of senders can beat
  (planner.balance), and `egress_unit_max`, the most the choice may exceed it by when holder sets are laminar.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

if TYPE_CHECKING:
    from .program import Program


@dataclass(frozen=True)
class Bounds:
    """Facts from the layouts that the ops alone do not tell, which `Accounting` sets the ops' bytes beside.

    Attributes:
        lower_bound_by_dst: per destination rank, the bytes of model data it must receive (padding excluded).
        model_bytes: the bytes of the whole model, each element once.
        gatherer_held_bytes: what trainer rank 0 already holds (gather-then-broadcast need not move it).
        egress_lower_bound: no choice of senders makes the busiest trainer rank send less.
        egress_unit_max: the largest unit of bytes assigned to one sender by choice.
        holder_sets_laminar: then the busiest sender sends at most `egress_lower_bound + egress_unit_max`.
    """

    lower_bound_by_dst: tuple[int, ...]
    model_bytes: int
    gatherer_held_bytes: int
    egress_lower_bound: int = 0
    egress_unit_max: int = 0
    holder_sets_laminar: bool = True

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values, as a saved plan holds them (`from_dict` reads them back)."""
        return {"lower_bound_by_dst": list(self.lower_bound_by_dst), "model_bytes": self.model_bytes,
                "gatherer_held_bytes": self.gatherer_held_bytes, "egress_lower_bound": self.egress_lower_bound,
                "egress_unit_max": self.egress_unit_max, "holder_sets_laminar": self.holder_sets_laminar}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Bounds":
        """The bounds `to_dict` wrote (the egress keys optional)."""
        return cls(tuple(d["lower_bound_by_dst"]), d["model_bytes"], d["gatherer_held_bytes"],
                   d.get("egress_lower_bound", 0), d.get("egress_unit_max", 0), d.get("holder_sets_laminar", True))


@dataclass(frozen=True)
class Accounting:
    """What a plan moves, where, and how far that is from the bounds (the module docstring defines each figure).

    Attributes:
        num_transfers: distinct (stage, sender, receiver) messages.
        egress_bytes: by source rank, what the trainer sends.
        ingress_bytes: by destination rank, what it receives.
        relay_egress_bytes: by destination rank, what it forwards in fan-out trees.
        pair_bytes: (source rank, destination rank, bytes) of every pair that moves any.
        relay_pair_bytes: (relaying destination rank, destination rank, bytes).
        num_stages: stages of the fan-out trees (1 without fan-out), and the slot copies' stage.
        slot_copy_bytes: bytes EPLB slot copies move (all replicas).
        slot_copy_local_bytes: of them, copies on the rank itself.
    """

    total_bytes: int
    cross_bytes: int
    local_bytes: int
    lower_bound_bytes: int
    gather_broadcast_bytes: int
    model_bytes: int
    num_ops: int
    num_transfers: int
    egress_bytes: tuple[int, ...]
    ingress_bytes: tuple[int, ...]
    relay_egress_bytes: tuple[int, ...]
    lower_bound_by_dst: tuple[int, ...]
    pair_bytes: tuple[tuple[int, int, int], ...]
    relay_pair_bytes: tuple[tuple[int, int, int], ...]
    num_stages: int
    egress_lower_bound: int = 0
    egress_unit_max: int = 0
    holder_sets_laminar: bool = True
    slot_copy_bytes: int = 0
    slot_copy_local_bytes: int = 0

    @property
    def max_egress(self) -> int:
        """What the busiest trainer rank sends: the figure trainer-side NIC time follows."""
        return max(self.egress_bytes, default=0)

    @property
    def max_ingress(self) -> int:
        """What the busiest destination rank receives."""
        return max(self.ingress_bytes, default=0)

    @property
    def egress_balance(self) -> float:
        """Busiest sender over the mean of the senders that send: 1.0 is perfectly balanced."""
        sending = [b for b in self.egress_bytes if b]
        return max(sending) / (sum(sending) / len(sending)) if sending else 1.0

    @property
    def egress_optimality(self) -> float:
        """Busiest sender over the bound no choice of senders can beat: 1.0 is provably optimal."""
        return self.max_egress / self.egress_lower_bound if self.egress_lower_bound else 1.0

    @property
    def max_relay_egress(self) -> int:
        """What the busiest relaying destination rank forwards."""
        return max(self.relay_egress_bytes, default=0)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values, the derived ratios included (for `reshard plan --json` and benchmarks)."""
        return {
            "total_bytes": self.total_bytes, "cross_bytes": self.cross_bytes, "local_bytes": self.local_bytes,
            "lower_bound_bytes": self.lower_bound_bytes, "gather_broadcast_bytes": self.gather_broadcast_bytes,
            "model_bytes": self.model_bytes, "num_ops": self.num_ops, "num_transfers": self.num_transfers,
            "egress_bytes": list(self.egress_bytes), "ingress_bytes": list(self.ingress_bytes),
            "relay_egress_bytes": list(self.relay_egress_bytes), "num_stages": self.num_stages,
            "egress_balance": round(self.egress_balance, 4),
            "egress_lower_bound": self.egress_lower_bound, "egress_unit_max": self.egress_unit_max,
            "egress_optimality": round(self.egress_optimality, 6), "holder_sets_laminar": self.holder_sets_laminar,
            "pair_bytes": [list(p) for p in self.pair_bytes],
            "relay_pair_bytes": [list(p) for p in self.relay_pair_bytes],
            "slot_copy_bytes": self.slot_copy_bytes, "slot_copy_local_bytes": self.slot_copy_local_bytes,
        }


def account(ops: dict[str, np.ndarray], itemsize: int, num_src: int, num_dst: int,
            colocation: Sequence[int] | None, bounds: Bounds, ranks_per_replica: int | None = None) -> Accounting:
    """colocation: per destination rank, the source rank on its device (None: not colocated); ranks_per_replica:
    tells EPLB slot copies (relays inside one replica) from fan-out relays (None: one replica)."""
    colocation = None if colocation is None else np.asarray(colocation, dtype=np.int64)
    nbytes = ops["rows"] * ops["cols"] * itemsize
    src, dst, relay = ops["src_rank"], ops["dst_rank"], ops["src_side"] == 1
    on_rank = relay & (src == dst)  # fan-out relays go to other replicas, never to their own rank
    copy = on_rank | (relay & (src // ranks_per_replica == dst // ranks_per_replica)) if ranks_per_replica else on_rank
    local = (src == colocation[dst]) & ~relay if colocation is not None else np.zeros(len(src), dtype=bool)
    sent = ~local & ~relay
    egress = np.bincount(src[sent], weights=nbytes[sent], minlength=num_src).astype(np.int64)
    relay_egress = np.bincount(src[relay], weights=nbytes[relay], minlength=num_dst).astype(np.int64)
    ingress = np.bincount(dst, weights=nbytes, minlength=num_dst).astype(np.int64)
    transfers = len(np.unique(np.stack([ops["stage"], ops["src_side"], src, dst]), axis=1)[0]) if len(src) else 0
    pairs = _pairs(src[~relay], dst[~relay], nbytes[~relay], num_dst)
    relay_pairs = _pairs(src[relay], dst[relay], nbytes[relay], num_dst)
    total = int(nbytes.sum())
    local_bytes = int(nbytes[local].sum())
    model = bounds.model_bytes
    return Accounting(
        total_bytes=total, cross_bytes=total - local_bytes, local_bytes=local_bytes,
        lower_bound_bytes=int(sum(bounds.lower_bound_by_dst)),
        gather_broadcast_bytes=(model - bounds.gatherer_held_bytes) + model * num_dst,
        model_bytes=model, num_ops=int(len(src)), num_transfers=transfers,
        egress_bytes=tuple(egress.tolist()), ingress_bytes=tuple(ingress.tolist()),
        relay_egress_bytes=tuple(relay_egress.tolist()),
        lower_bound_by_dst=tuple(bounds.lower_bound_by_dst), pair_bytes=pairs, relay_pair_bytes=relay_pairs,
        num_stages=int(ops["stage"].max()) + 1 if len(src) else 0,
        slot_copy_bytes=int(nbytes[copy].sum()), slot_copy_local_bytes=int(nbytes[on_rank].sum()),
        **_balance_fields(bounds),
    )


def _balance_fields(bounds: Bounds) -> dict[str, Any]:
    return {"egress_lower_bound": bounds.egress_lower_bound, "egress_unit_max": bounds.egress_unit_max,
            "holder_sets_laminar": bounds.holder_sets_laminar}


def account_program(p: "Program", itemsize: int, num_src: int, num_dst: int, colocation: Sequence[int] | None,
                    bounds: Bounds) -> Accounting:
    """The same accounting as `account`, computed from the factored ops without expanding them: per group of
    template ops and fed replica for what the source sends, per replica for what relays forward."""
    colocation = None if colocation is None else np.asarray(colocation, dtype=np.int64)
    t, rpr, K = p.template, p.ranks_per_replica, p.num_replicas
    op_bytes = t["rows"] * t["cols"] * itemsize
    G = len(p.group_box)
    group_bytes = np.bincount(t["group"], weights=op_bytes, minlength=G).astype(np.int64)
    first = np.searchsorted(t["group"], np.arange(G))
    holder = p.holder_of_group()  # (R, G)
    dst = t["dst_rank"][first][None, :] + p.fed[:, None] * rpr
    w = np.broadcast_to(group_bytes[None, :], holder.shape)
    ps, pd, pb = _pair_arrays(holder.ravel(), dst.ravel(), w.ravel(), num_dst)
    pairs = tuple(zip(ps.tolist(), pd.tolist(), pb.tolist()))
    local = (ps == colocation[pd]) if colocation is not None else np.zeros(len(ps), dtype=bool)
    egress = np.bincount(ps[~local], weights=pb[~local], minlength=num_src).astype(np.int64)
    local_bytes = int(pb[local].sum())
    per_pos = np.bincount(t["dst_rank"], weights=op_bytes, minlength=rpr).astype(np.int64)
    r = p.relay
    P = p.num_parts
    part_pos = np.bincount(r["part"] * rpr + r["dst_rank"], weights=r["rows"] * r["cols"] * itemsize,
                           minlength=P * rpr).astype(np.int64).reshape(P, rpr)
    jj, kk = np.nonzero(p.parent >= 0)  # (part, relayed replica)
    senders = (p.parent[jj, kk][:, None] * rpr + np.arange(rpr)[None, :]).ravel()
    receivers = (kk[:, None] * rpr + np.arange(rpr)[None, :]).ravel()
    stages = np.repeat(p.stage[jj, kk], rpr)
    rb = part_pos[jj].ravel()
    nz = rb > 0
    senders, receivers, stages, rb = senders[nz], receivers[nz], stages[nz], rb[nz]
    c = p.copies  # EPLB slot copies: every replica's, in their own stage
    c_bytes = c["rows"] * c["cols"] * itemsize
    per_pos += np.bincount(c["dst_rank"], weights=c_bytes, minlength=rpr).astype(np.int64)
    off = (np.arange(K) * rpr)[:, None]
    c_src, c_dst = (off + c["src_rank"][None, :]).ravel(), (off + c["dst_rank"][None, :]).ravel()
    c_b = np.tile(c_bytes, K)
    copy_bytes, copy_local = int(c_b.sum()), int(c_b[c_src == c_dst].sum())
    senders, receivers = np.concatenate([senders, c_src]), np.concatenate([receivers, c_dst])
    rb = np.concatenate([rb, c_b])
    stages = np.concatenate([stages, np.full(len(c_b), p.copy_stage, np.int64)])
    relay_egress = np.bincount(senders, weights=rb, minlength=num_dst).astype(np.int64)
    relay_pairs = _pairs(senders, receivers, rb, num_dst)
    relay_transfers = len(np.unique((stages * num_dst + senders) * num_dst + receivers)) if len(rb) else 0
    total = int(op_bytes.sum()) * K + copy_bytes
    model = bounds.model_bytes
    return Accounting(
        total_bytes=total, cross_bytes=total - local_bytes, local_bytes=local_bytes,
        lower_bound_bytes=int(sum(bounds.lower_bound_by_dst)),
        gather_broadcast_bytes=(model - bounds.gatherer_held_bytes) + model * num_dst,
        model_bytes=model, num_ops=p.num_ops, num_transfers=len(pairs) + relay_transfers,
        egress_bytes=tuple(egress.tolist()), ingress_bytes=tuple(np.tile(per_pos, K).tolist()),
        relay_egress_bytes=tuple(relay_egress.tolist()), lower_bound_by_dst=tuple(bounds.lower_bound_by_dst),
        pair_bytes=pairs, relay_pair_bytes=relay_pairs,
        num_stages=(p.copy_stage if p.num_copy_ops else int(p.stage.max())) + 1 if p.num_ops else 0,
        slot_copy_bytes=copy_bytes, slot_copy_local_bytes=copy_local, **_balance_fields(bounds),
    )


def _pair_arrays(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray,
                 num_dst: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src, dst, bytes) summed per pair, sorted by (src, dst); every entry moves at least one byte."""
    key = src * num_dst + dst
    span = (int(src.max(initial=0)) + 1) * num_dst
    if span <= 1 << 26:  # a dense table: no sort
        dense = np.bincount(key, weights=nbytes, minlength=span)
        keys = np.flatnonzero(dense)
        sums = dense[keys].astype(np.int64)
    else:
        keys, inverse = np.unique(key, return_inverse=True)
        sums = np.bincount(inverse, weights=nbytes).astype(np.int64) if len(keys) else np.zeros(0, np.int64)
    return keys // num_dst, keys % num_dst, sums


def _pairs(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, num_dst: int) -> tuple[tuple[int, int, int], ...]:
    return tuple(zip(*(x.tolist() for x in _pair_arrays(src, dst, nbytes, num_dst))))
