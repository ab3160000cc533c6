"""Byte accounting of a plan, beside the lower bound and the gather-then-broadcast pattern.

- total_bytes: what all ops move; cross_bytes / local_bytes: across devices vs. same-device copies (colocated);
- lower_bound_bytes: each destination rank's share of model data (padding excluded), which an exact plan meets;
- gather_broadcast_bytes: the common RL refit: gather the model onto one trainer rank, broadcast it to every
  destination rank;
- slot_copy_bytes: what EPLB engines' redundant expert slots copy inside the engine (planner.fanout.slot_copies),
  of it slot_copy_local_bytes on the rank itself;
- egress: the busiest trainer sender beside `egress_lower_bound`, which no choice of senders beats, and
  `egress_unit_max`, the most it may exceed it by when holder sets are laminar (planner.balance).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from .merge import distinct

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
        """Plain JSON values, as a saved plan holds them (planner.verify reads them back)."""
        return {**asdict(self), "lower_bound_by_dst": list(self.lower_bound_by_dst)}


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
        out = {k: [list(x) if isinstance(x, tuple) else x for x in v] if isinstance(v, tuple) else v
               for k, v in asdict(self).items() if k != "lower_bound_by_dst"}
        return {**out, "egress_balance": round(self.egress_balance, 4),
                "egress_optimality": round(self.egress_optimality, 6)}


def flows(p: "Program", itemsize: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """What moves between which ranks, from the factored ops without expanding them: (what the source sends, per
    fed replica and group of template ops; what destination ranks relay, per part, relayed replica and position,
    then every replica's slot copies), each as columns stage, src, dst, bytes, ops (relays also `copy`)."""
    t, rpr, K = p.template, p.ranks_per_replica, p.num_replicas
    G, R = len(p.group_box), len(p.fed)
    first = np.searchsorted(t["group"], np.arange(G))
    fed = {"stage": np.repeat(p.stage[0, p.fed], G),
           "src": p.h_rank[p.box_hstart[p.group_box][None, :] + p.choice].ravel(),  # each group's holder
           "dst": (t["dst_rank"][first][None, :] + p.fed[:, None] * rpr).ravel(),
           "bytes": np.tile(np.bincount(t["group"], weights=t["rows"] * t["cols"], minlength=G), R) * itemsize,
           "ops": np.tile(np.bincount(t["group"], minlength=G), R)}
    r, P = p.relay, p.num_parts
    key = r["part"] * rpr + r["dst_rank"]
    pos_elems = np.bincount(key, weights=r["rows"] * r["cols"], minlength=P * rpr).reshape(P, rpr)
    pos_ops = np.bincount(key, minlength=P * rpr).reshape(P, rpr)
    jj, kk = np.nonzero(p.parent >= 0)  # (part, relayed replica)
    j, k, pos = np.repeat(jj, rpr), np.repeat(kk, rpr), np.tile(np.arange(rpr), len(kk))
    some = pos_ops[j, pos] > 0
    j, k, pos = j[some], k[some], pos[some]
    c = p.copies  # EPLB slot copies: every replica's, in a stage of their own
    n = K * p.num_copy_ops
    off = np.repeat(np.arange(K) * rpr, p.num_copy_ops)
    relay = {"stage": np.concatenate([p.stage[j, k], np.full(n, p.copy_stage)]),
             "src": np.concatenate([p.parent[j, k] * rpr + pos, off + np.tile(c["src_rank"], K)]),
             "dst": np.concatenate([k * rpr + pos, off + np.tile(c["dst_rank"], K)]),
             "bytes": np.concatenate([pos_elems[j, pos], np.tile(c["rows"] * c["cols"], K)]) * itemsize,
             "ops": np.concatenate([pos_ops[j, pos], np.ones(n, np.int64)]),
             "copy": np.concatenate([np.zeros(len(k), bool), np.ones(n, bool)])}
    for cols in (fed, relay):
        for name in ("stage", "src", "dst", "bytes", "ops"):
            cols[name] = cols[name].astype(np.int64)
    return fed, relay


def account_program(p: "Program", itemsize: int, num_src: int, num_dst: int, colocation: Sequence[int] | None,
                    bounds: Bounds) -> Accounting:
    """The Accounting of program `p`, beside `bounds`, computed from the factored ops without expanding them
    (`flows`). colocation: per destination rank, the source rank on its device (None: not colocated)."""
    fed, r = flows(p, itemsize)
    ps, pd, pb = _pair_arrays(fed["src"], fed["dst"], fed["bytes"], num_dst)
    local = (ps == np.asarray(colocation)[pd]) if colocation is not None else np.zeros(len(ps), dtype=bool)
    copy = r["bytes"][r["copy"]]
    total, local_bytes, model = int(pb.sum() + r["bytes"].sum()), int(pb[local].sum()), bounds.model_bytes

    def count(ranks: np.ndarray, nbytes: np.ndarray, n: int) -> tuple[int, ...]:
        return tuple(np.bincount(ranks, weights=nbytes, minlength=n).astype(np.int64).tolist())

    return Accounting(
        total_bytes=total, cross_bytes=total - local_bytes, local_bytes=local_bytes,
        lower_bound_bytes=int(sum(bounds.lower_bound_by_dst)),
        gather_broadcast_bytes=(model - bounds.gatherer_held_bytes) + model * num_dst, num_ops=p.num_ops,
        num_transfers=len(ps) + (len(np.unique((r["stage"] * num_dst + r["src"]) * num_dst + r["dst"]))),
        egress_bytes=count(ps[~local], pb[~local], num_src),
        ingress_bytes=count(np.concatenate([fed["dst"], r["dst"]]), np.concatenate([fed["bytes"], r["bytes"]]),
                            num_dst),
        relay_egress_bytes=count(r["src"], r["bytes"], num_dst),
        pair_bytes=tuple(zip(ps.tolist(), pd.tolist(), pb.tolist())),
        relay_pair_bytes=tuple(zip(*(x.tolist() for x in _pair_arrays(r["src"], r["dst"], r["bytes"], num_dst)))),
        num_stages=(p.copy_stage if p.num_copy_ops else int(p.stage.max())) + 1 if p.num_ops else 0,
        **{k: v for k, v in asdict(bounds).items() if k != "gatherer_held_bytes"},  # the layouts' figures
        slot_copy_bytes=int(copy.sum()), slot_copy_local_bytes=int(copy[(r["src"] == r["dst"])[r["copy"]]].sum()))


def _pair_arrays(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray,
                 num_dst: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src, dst, bytes) summed per pair, sorted by (src, dst); every entry moves at least one byte."""
    keys, inverse = distinct(src * num_dst + dst)
    sums = np.bincount(inverse, weights=nbytes, minlength=len(keys)).astype(np.int64)
    keys, sums = keys[sums > 0], sums[sums > 0]
    return keys // num_dst, keys % num_dst, sums
