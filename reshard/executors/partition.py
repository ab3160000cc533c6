"""Who moves each op of a plan under a binding, and what one process does: written once for every executor.

Each op has a sending process (the binding's process for its source rank, or its relaying destination rank) and a
receiving process; an op whose two are one is LOCAL (a copy). The remote ops of one (stage, sender, receiver) form
a STREAM, numbered in that sort order, the same on every process. `Partition` holds that split seen from one
process, plus the staging pieces every staged executor needs (pure numpy, computed once per executor). `Prepared`
holds the process's tensors made ready for an executor: checked against the plan (`check_tensors`, `check_memory`,
and the binding's ranks), seen in the plan's units (`in_units`) and kept as flat views by tensor id (the SRC / DST
memory of executors.copies).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import numpy as np
import torch

from ..errors import ExecutionError
from ..planner import Plan
from ..planner.plan import RELAY, SOURCE
from .base import RankTensors
from .binding import Binding
from .copies import DST, SHADOW, SRC, WIRE, Copies, fold
from .preflight import check_memory
from .reference import check_tensors, in_units, op_blocks, shift_views, torch_dtype

PIECE_COLUMNS = ("send_kind", "send_id", "send_off", "recv_kind", "recv_id", "recv_off", "numel")  # row_pieces
ALIGN = 64  # elements: every arena region starts 128-byte aligned (bf16) so that word views apply


def carve(sizes: "list[int] | np.ndarray", align: int) -> tuple[list[int], int]:
    """Start offsets of regions of `sizes` elements laid end to end in one buffer, each start a multiple of `align`
    elements (so that word views apply to every region), and the buffer's length. The one layout of every staging
    arena (shadows, wire buffers)."""
    padded = [-(-max(int(n), 1) // align) * align for n in sizes]
    starts = np.concatenate([[0], np.cumsum(padded, dtype=np.int64)]).tolist()
    return [int(s) for s in starts[:-1]], int(starts[-1]) if len(padded) else 0


@dataclass(frozen=True, eq=False)
class Partition:
    """A plan's ops split between the processes of a binding, seen from `process` (see the module docstring)."""

    plan: Plan
    binding: Binding
    process: int

    def __post_init__(self) -> None:
        self.binding.check(self.plan.src.num_ranks, self.plan.dst.num_ranks)  # a process may play no rank

    # --- the global split (the same on every process) ------------------------------------------------
    @cached_property
    def sender(self) -> np.ndarray:
        """Per op, the process that sends it (a relay's sender plays a destination rank)."""
        o = self.plan.ops
        src, dst = np.asarray(self.binding.src, np.int64), np.asarray(self.binding.dst, np.int64)
        return np.where(o["src_side"] == SOURCE, src[np.minimum(o["src_rank"], len(src) - 1)],
                        dst[np.minimum(o["src_rank"], len(dst) - 1)])

    @cached_property
    def receiver(self) -> np.ndarray:
        """Per op, the process that receives it."""
        return np.asarray(self.binding.dst, np.int64)[self.plan.ops["dst_rank"]]

    @cached_property
    def streams(self) -> tuple[np.ndarray, np.ndarray]:
        """(stream of every op, -1 for local ones; (stage, sender, receiver) of every stream, sorted)."""
        sender, receiver = self.sender, self.receiver
        remote = sender != receiver
        stream = np.full(self.plan.num_ops, -1, np.int64)
        if not remote.any():
            return stream, np.zeros((0, 3), np.int64)
        keys = np.stack([self.plan.ops["stage"][remote], sender[remote], receiver[remote]], axis=1)
        uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
        stream[remote] = inverse.reshape(-1)
        return stream, uniq

    def most_streams(self) -> int:
        """The most streams (peers sent to plus peers received from) any process has in one stage."""
        keys = self.streams[1]
        if not len(keys):
            return 0
        per = np.concatenate([keys[:, [0, 1]], keys[:, [0, 2]]])
        return int(np.unique(per, axis=0, return_counts=True)[1].max())

    # --- this process --------------------------------------------------------------------------------
    @cached_property
    def local(self) -> np.ndarray:
        """Ops this process both sends and receives (plan order)."""
        return np.flatnonzero((self.sender == self.process) & (self.receiver == self.process))

    @cached_property
    def received(self) -> np.ndarray:
        """Ops a peer sends this process (plan order)."""
        return np.flatnonzero((self.receiver == self.process) & (self.sender != self.process))

    @cached_property
    def sent(self) -> np.ndarray:
        """Ops this process sends a peer (plan order)."""
        return np.flatnonzero((self.sender == self.process) & (self.receiver != self.process))

    @cached_property
    def landing(self) -> np.ndarray:
        """Every op this process receives, local or remote (plan order)."""
        return np.flatnonzero(self.receiver == self.process)

    @cached_property
    def sends_to(self) -> dict[int, np.ndarray]:
        """Peer -> the ops this process sends it (plan order)."""
        return _by(self.sent, self.receiver)

    @cached_property
    def receives_from(self) -> dict[int, np.ndarray]:
        """Peer -> the ops it sends this process (plan order)."""
        return _by(self.received, self.sender)

    @property
    def peers(self) -> tuple[int, ...]:
        """The processes this one sends to or receives from, sorted."""
        return tuple(sorted(set(self.sends_to) | set(self.receives_from)))

    @cached_property
    def src_ids(self) -> tuple[int, ...]:
        """Source tensor ids of the source ranks this process plays."""
        mine = self.binding.src_ranks_of(self.process)
        return tuple(np.flatnonzero(np.isin(self.plan.src_tensors.rank, mine)).tolist())

    @cached_property
    def dst_ids(self) -> tuple[int, ...]:
        """Destination tensor ids of the destination ranks this process plays."""
        mine = self.binding.dst_ranks_of(self.process)
        return tuple(np.flatnonzero(np.isin(self.plan.dst_tensors.rank, mine)).tolist())

    @cached_property
    def relay_sources(self) -> np.ndarray:
        """Destination tensors this process forwards bytes from (fan-out relays it sends)."""
        o = self.plan.ops
        relays = np.flatnonzero((self.sender == self.process) & (o["src_side"] == RELAY))
        return np.unique(o["src_tensor"][relays])

    @cached_property
    def in_flight(self) -> np.ndarray:
        """Per destination tensor: written while a refit is in flight (it receives bytes from a peer, or this
        process forwards from it). A staged refit gives these a shadow; local copies into any other tensor wait
        for the commit."""
        mask = np.zeros(len(self.plan.dst_tensors), dtype=bool)
        mask[self.plan.ops["dst_tensor"][self.received]] = True
        mask[self.relay_sources] = True
        return mask

    # --- staging -------------------------------------------------------------------------------------
    def commit(self, shadowed: np.ndarray) -> Copies:
        """Shadow -> destination copies of the tensors `shadowed` (a mask): a tensor the ops received here write
        whole is one contiguous copy, any other one copy per op."""
        o, sizes = self.plan.ops, self.tensor_sizes
        ops = self.landing[shadowed[o["dst_tensor"][self.landing]]]
        t = o["dst_tensor"][ops]
        written = np.bincount(t, weights=o["rows"][ops] * o["cols"][ops], minlength=len(sizes)).astype(np.int64)
        ids = np.flatnonzero(shadowed & (written == sizes))
        p = ops[~np.isin(t, ids)]  # folding nothing makes no copy
        return Copies.concat([fold(SHADOW, ids, 0, sizes[ids], DST, ids, 0, sizes[ids], 1, sizes[ids]),
                              fold(SHADOW, o["dst_tensor"][p], o["dst_offset"][p], o["dst_stride"][p], DST,
                                   o["dst_tensor"][p], o["dst_offset"][p], o["dst_stride"][p], o["rows"][p],
                                   o["cols"][p])])

    def local_copies(self, shadowed: np.ndarray, defer: "np.ndarray | None" = None) -> tuple[list[Copies], Copies]:
        """This process's local copies: per stage, those run while the refit is in flight (into a destination
        tensor's shadow where `shadowed` gives it one), and those deferred to the commit, straight into the
        destination: the copies into tensors `defer` marks (a staged or undone refit defers tensors that take
        nothing while in flight: they need neither a shadow nor a backup)."""
        o = self.plan.ops
        d_t = o["dst_tensor"][self.local]
        later = np.zeros(len(self.local), bool) if defer is None else defer[d_t]
        kind = self.read_kind(self.local, shadowed)
        into = np.where(shadowed[d_t], SHADOW, DST)
        stage = o["stage"][self.local]
        now = [op_copies(self.plan, self.local[m], kind[m], into[m])
               for m in (~later & (stage == s) for s in range(self.plan.num_stages))]
        return now, op_copies(self.plan, self.local[later], kind[later], DST)

    def read_kind(self, ops: np.ndarray, shadowed: np.ndarray) -> np.ndarray:
        """Per op, the memory it reads: SRC for source ops; for relays the destination tensor, or its shadow."""
        o = self.plan.ops
        relay = o["src_side"][ops] == RELAY
        kind = np.full(len(ops), SRC, np.int64)
        kind[relay] = np.where(shadowed[o["src_tensor"][ops][relay]], SHADOW, DST)
        return kind

    @cached_property
    def tensor_sizes(self) -> np.ndarray:
        """Elements of every destination tensor (plan units)."""
        return self.plan.dst_tensors.numel()

    # --- byte counts ---------------------------------------------------------------------------------
    def numel(self, ops: np.ndarray) -> int:
        """Elements the ops `ops` (indices into the plan's ops) move."""
        o = self.plan.ops
        return int((o["rows"][ops] * o["cols"][ops]).sum())

    @cached_property
    def bytes_sent(self) -> dict[int, int]:
        """Peer -> the bytes this process sends it per refit."""
        return {q: self.numel(ops) * self.plan.itemsize for q, ops in self.sends_to.items()}

    @cached_property
    def bytes_received(self) -> dict[int, int]:
        """Peer -> the bytes it sends this process per refit."""
        return {q: self.numel(ops) * self.plan.itemsize for q, ops in self.receives_from.items()}

    @cached_property
    def local_numel(self) -> int:
        """Elements this process copies locally per refit."""
        return self.numel(self.local)


def op_copies(plan: Plan, ops: np.ndarray, src_kind: "int | np.ndarray", dst_kind: "int | np.ndarray") -> Copies:
    """The plan ops `ops` as one folded program from `src_kind` memory (SRC; a relay reads its destination tensor,
    in the kind given for it) to `dst_kind` memory at the destination tensors' places."""
    o = plan.ops
    return fold(src_kind, o["src_tensor"][ops], o["src_offset"][ops], o["src_stride"][ops], dst_kind,
                o["dst_tensor"][ops], o["dst_offset"][ops], o["dst_stride"][ops], o["rows"][ops], o["cols"][ops])


def _by(ops: np.ndarray, peer_of: np.ndarray) -> dict[int, np.ndarray]:
    peers = peer_of[ops]
    return {int(q): ops[peers == q] for q in np.unique(peers).tolist()}


def row_pieces(plan: Plan, ops: np.ndarray, staged: bool, link: int | None = None, base: int = 0) \
        -> dict[str, np.ndarray]:
    """Contiguous pieces (PIECE_COLUMNS) of `ops` in op order, coalesced: one per row (a strided block's rows)
    into their destination memory, or with `link` (a NIXL link's landed ops) one per op into its receive buffer
    after `base` elements. The send side reads the source tensor, or for relays the landing memory (shadow when
    staged)."""
    o = plan.ops
    rows = o["rows"][ops] if link is None else np.ones(len(ops), np.int64)
    rep = np.repeat(np.arange(len(ops)), rows)
    r = np.arange(len(rep)) - np.repeat(np.cumsum(rows) - rows, rows)
    idx = ops[rep]
    if link is None:
        numel = o["cols"][idx]
        recv = (SHADOW if staged else DST, o["dst_tensor"][idx], o["dst_offset"][idx] + r * o["dst_stride"][idx])
    else:
        numel = o["rows"][ops] * o["cols"][ops]
        recv = (WIRE, link, base + np.cumsum(numel) - numel)
    kind, ident, off = (np.broadcast_to(np.asarray(x, np.int64), (len(rep),)) for x in recv)
    return coalesce({"send_kind": np.where(o["src_side"][idx] == RELAY, SHADOW if staged else DST, SRC),
                     "send_id": o["src_tensor"][idx], "send_off": o["src_offset"][idx] + r * o["src_stride"][idx],
                     "recv_kind": kind, "recv_id": ident, "recv_off": off, "numel": numel})


def coalesce(p: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Join consecutive pieces that continue each other on both sides."""
    n = len(p["numel"])
    if n < 2:
        return p
    join = ((p["send_kind"][1:] == p["send_kind"][:-1]) & (p["send_id"][1:] == p["send_id"][:-1])
            & (p["recv_kind"][1:] == p["recv_kind"][:-1]) & (p["recv_id"][1:] == p["recv_id"][:-1])
            & (p["send_off"][1:] == p["send_off"][:-1] + p["numel"][:-1])
            & (p["recv_off"][1:] == p["recv_off"][:-1] + p["numel"][:-1]))
    if not join.any():
        return p
    starts = np.flatnonzero(np.concatenate([[True], ~join]))
    out = {k: v[starts] for k, v in p.items()}
    out["numel"] = np.add.reduceat(p["numel"], starts)
    return out


class Prepared:
    """A process's tensors, checked and viewed (module docstring).

    Args:
        binding: `src` / `dst` must give exactly the ranks it has `process` play; None: any.
        ids: (source ids, destination ids): check only these tensors; None: every tensor of the ranks given.

    Raises:
        ExecutionError: other ranks than the binding's, tensors that do not match the plan, overlapping or
            memoryless tensors.
    """

    def __init__(self, plan: Plan, src: RankTensors, dst: RankTensors, binding: "Binding | None" = None,
                 process: int = 0, ids: "tuple | None" = None) -> None:
        ranks = () if binding is None else (binding.src_ranks_of(process), binding.dst_ranks_of(process))
        wrong = [f"{side} ranks given {sorted(got)}, but the binding has this process play {sorted(want)}"
                 for side, got, want in zip(("source", "destination"), (src, dst), ranks) if set(got) != set(want)]
        if wrong:
            raise ExecutionError("; ".join(wrong))
        check_tensors(plan, src, dst, ids)
        check_memory(src, dst)
        self.plan, self.src, self.dst = plan, src, dst
        self.tensors = [t for side in (src, dst) for ts in side.values() for t in ts.values()]
        self.devices = {t.device for t in self.tensors}
        units = in_units(plan, src, dst)  # tensors kept in a wider dtype, seen in the plan's
        self.src_flat, self.dst_flat = ({i: ts[r][n].view(-1) for i, (r, n) in enumerate(zip(table.ranks, table.names))
                                         if r in ts and n in ts[r]}  # tensor id -> flat view, where given
                                        for table, ts in ((plan.src_tensors, units[0]), (plan.dst_tensors, units[1])))
        self.dtype = torch_dtype(plan.dst.dtype)

    @property
    def device(self) -> "torch.device | None":
        """The one device of the tensors (None: no tensors); ExecutionError if they are on several."""
        if len(self.devices) > 1:
            raise ExecutionError(f"this process's tensors are on several devices {sorted(map(str, self.devices))}")
        return next(iter(self.devices), None)

    def shifts(self, ops: "np.ndarray | None" = None) -> list[tuple[torch.Tensor, float]]:
        """(view, value) of the value shifts of the destination blocks of `ops` (default every op) held here."""
        return shift_views(self.plan, self.dst_flat, ops)

    def blocks(self, ops: np.ndarray, side: str = "src", flat: "dict[int, torch.Tensor] | None" = None) \
            -> list[torch.Tensor]:
        """The blocks `ops` read (side "src") or write ("dst"), in op order, as views of `flat` (default this
        process's tensors of that side)."""
        flat = flat if flat is not None else (self.src_flat if side == "src" else self.dst_flat)
        return op_blocks(self.plan, ops, side, flat)

    def arena(self, sizes: "dict[object, int]", device: "torch.device | None" = None,
              allocate: "Callable[[int], torch.Tensor] | None" = None) \
            -> tuple[torch.Tensor, dict[object, torch.Tensor]]:
        """One buffer holding a region of `sizes[key]` elements per key, each start ALIGN-aligned; returns it and
        each key's view. `allocate(numel)` makes the buffer (default: uninitialised, on `device` or the tensors')."""
        starts, total = carve(list(sizes.values()), ALIGN) if sizes else ([], 0)
        buffer = (allocate or (lambda n: torch.empty(n, dtype=self.dtype, device=device or self.device or "cpu")))(
            total)
        return buffer, {k: buffer.narrow(0, a, n) for (k, n), a in zip(sizes.items(), starts)}


__all__ = ["ALIGN", "Partition", "Prepared", "PIECE_COLUMNS", "carve", "coalesce", "op_copies", "row_pieces"]
