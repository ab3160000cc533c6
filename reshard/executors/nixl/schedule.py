"""One process's part of a plan over NIXL, as plain arrays: links, descriptor pieces, copy programs, staging.

Pure numpy: every process derives the same global link numbering, so both ends of a link build the same pieces.
1. Ops whose sending and receiving processes are one are LOCAL copies; the remote ops of one (stage, sender,
   receiver) form a LINK (one NIXL transfer, prepared once, re-posted at every refit).
2. An op of a link moves DIRECT (one descriptor per contiguous piece, coalesced), PACKED (gathered into a send
   buffer, one descriptor into a receive buffer, scattered there: for links with several pieces below
   `pack_below` bytes) or LANDED (a run contiguous on the sender that falls apart into many short pieces on the
   receiver, such as a fused QKV weight's blocks: one descriptor into the receive buffer, then one scatter).
3. Staged: a destination tensor that receives direct bytes from a peer, or that this process relays from, gets a
   SHADOW in the staging arena, copied in at commit; packed receive buffers and local copies also land at commit.

Memory is named (kind, id) as in executors.copies: SRC / DST the caller's tensors, SHADOW a staging copy of a
destination tensor, WIRE a link's packed buffer (id = link id); SHADOW and WIRE live in one arena per process.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...errors import ExecutionError
from ...planner import Plan
from ..binding import Binding
from ..collective.schedule import run_starts
from ..copies import DST, SHADOW, SRC, WIRE, Copies, fold
from ..partition import PIECE_COLUMNS, Partition, carve, row_pieces
from .options import NixlOptions

BLOCK_COLUMNS = ("src_kind", "src_id", "src_off", "src_stride", "dst_kind", "dst_id", "dst_off", "dst_stride",
                 "rows", "cols")  # the arguments of `fold`
ARENA_ALIGN_BYTES = 512


@dataclass(frozen=True, eq=False)
class Link:
    """The remote ops of one (stage, sender, receiver): one NIXL transfer."""

    id: int
    stage: int
    sender: int
    receiver: int
    ops: np.ndarray  # op indices, plan order
    numel: int
    packed_ops: np.ndarray  # the ops moved through the send / receive buffers, plan order
    packed_numel: int
    pieces: dict[str, np.ndarray]  # PIECE_COLUMNS: direct pieces (coalesced), landed runs, the packed buffer
    direct_pieces: int  # about how many pieces it would move with nothing packed or landed
    landed_ops: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # read whole, scattered here
    landed_numel: int = 0

    def peer(self, process: int) -> int:
        """The other end of the link, seen from `process`."""
        return self.sender if self.receiver == process else self.receiver

    @property
    def recv_numel(self) -> int:
        """Elements of the receive buffer: packed ops, then landed runs."""
        return self.packed_numel + self.landed_numel

    @property
    def buffered_ops(self) -> np.ndarray:
        """Ops that arrive in the receive buffer, in its order."""
        return np.concatenate([self.packed_ops, self.landed_ops])

    @property
    def packed(self) -> bool:
        """Whether some of the link's ops travel through the packed send / receive buffers."""
        return self.packed_numel > 0

    @property
    def num_pieces(self) -> int:
        """How many descriptors the link's transfer moves."""
        return int(self.pieces["numel"].shape[0])

    def __str__(self) -> str:
        how = (f"{self.num_pieces} descriptors" + (" with a packed buffer" if self.packed else "")
               + (f", {len(self.landed_ops)} ops landed" if self.landed_numel else ""))
        return f"link {self.id} (stage {self.stage}, process {self.sender} -> {self.receiver}, {how})"


@dataclass(frozen=True, eq=False)
class LinkSchedule:
    """What one process does in a refit; see the module docstring."""

    process: int
    direction: str  # "read" or "write"
    staged: bool
    num_stages: int
    incoming: tuple[Link, ...]
    outgoing: tuple[Link, ...]
    pack: dict[int, Copies]  # outgoing packed link -> gather into its send buffer
    arrive: dict[int, Copies]  # incoming packed link -> scatter run as soon as it has arrived
    local: tuple[Copies, ...]  # per stage, run while the refit is in flight
    commit: Copies  # run after every process verified its refit (staged only)
    shadow: tuple[int, ...]  # destination tensor ids with a shadow
    arena: dict[tuple[int, int], tuple[int, int]]  # (kind, id) -> (element offset, numel)
    arena_numel: int
    exposed: tuple[tuple[int, int], ...]  # memories whose addresses peers need
    part: Partition  # the partition it is cut from (its peers, the bytes it sends, receives and copies)

    @property
    def links(self) -> tuple[Link, ...]:
        """Every link of this process: incoming, then outgoing."""
        return self.incoming + self.outgoing

    def initiates(self, link: Link) -> bool:
        """Whether this process posts `link`'s transfer (the receiver reads, the sender writes)."""
        return (link.receiver if self.direction == "read" else link.sender) == self.process


def _landed(plan: Plan, ops: np.ndarray, land_below: int) -> np.ndarray:
    """Which direct ops to land: runs of ops contiguous in the sender's memory whose pieces on the receiver are
    several and average below `land_below` bytes."""
    if len(ops) < 2:
        return np.zeros(len(ops), dtype=bool)
    o = plan.ops
    rows, cols = o["rows"][ops], o["cols"][ops]
    run = np.cumsum(run_starts(o, ops, "src")) - 1
    dst_flat = (rows == 1) | (cols == o["dst_stride"][ops])
    pieces = np.bincount(run, weights=np.where(dst_flat, 1, rows)).astype(np.int64)  # before coalescing
    run_numel = np.bincount(run, weights=rows * cols).astype(np.int64)
    land = (pieces >= 2) & (run_numel * plan.itemsize < land_below * pieces)
    return land[run] & ((rows == 1) | (cols == o["src_stride"][ops]))


def _wire_copies(plan: Plan, ops: np.ndarray, kind, link: int, offsets: np.ndarray, gather: bool) \
        -> dict[str, np.ndarray]:
    """Copies of `ops` between their memory of `kind` and link `link`'s packed buffer (rows contiguous from
    `offsets`): from the source side into the buffer (`gather`), else from the buffer into the destination side."""
    o = plan.ops
    side = "src" if gather else "dst"
    mem = {"kind": kind, "id": o[f"{side}_tensor"][ops], "off": o[f"{side}_offset"][ops],
           "stride": o[f"{side}_stride"][ops]}
    wire = {"kind": WIRE, "id": link, "off": offsets, "stride": o["cols"][ops]}
    frm, to = (mem, wire) if gather else (wire, mem)
    cols = {"rows": o["rows"][ops], "cols": o["cols"][ops], **{f"src_{k}": v for k, v in frm.items()},
            **{f"dst_{k}": v for k, v in to.items()}}
    return {c: np.broadcast_to(np.asarray(cols[c], dtype=np.int64), (len(ops),)) for c in BLOCK_COLUMNS}


def choose_direction(plan: Plan, binding: Binding, requested: str) -> str:
    """"read" or "write"; "auto" picks the one whose busiest initiator starts the fewest bytes, READ on a tie."""
    if requested != "auto":
        return requested
    link_of_op, keys = Partition(plan, binding, 0).streams  # links are the partition's streams
    if not len(keys):
        return "read"
    nbytes = np.bincount(link_of_op[link_of_op >= 0], weights=plan.op_bytes()[link_of_op >= 0], minlength=len(keys))
    read, write = (np.bincount(keys[:, k], weights=nbytes, minlength=binding.num_processes).max() for k in (2, 1))
    return "write" if write < read else "read"


def build_schedule(plan: Plan, binding: Binding, process: int, options: NixlOptions,
                   pack_below: int, land_below: int = 0) -> LinkSchedule:
    """This process's part of the plan (see the module docstring). Ops with pieces below `pack_below` bytes
    are packed; runs whose receiver pieces average below `land_below` bytes are landed."""
    if not 0 <= process < binding.num_processes:
        raise ExecutionError(f"process {process} is outside the binding's processes 0..{binding.num_processes - 1}")
    o, staged = plan.ops, options.staged
    part = Partition(plan, binding, process)
    link_of_op, keys = part.streams
    order = np.argsort(link_of_op, kind="stable")  # both ends build the same Link from the same ops
    starts = np.concatenate([[0], np.cumsum(np.bincount(link_of_op[link_of_op >= 0], minlength=len(keys)))]) \
        + int((link_of_op < 0).sum())
    link = lambda lid: _link(plan, lid, keys[lid], np.sort(order[starts[lid]:starts[lid + 1]]), options,  # noqa: E731
                             pack_below, land_below)
    incoming = tuple(link(i) for i in np.flatnonzero(keys[:, 2] == process).tolist())
    outgoing = tuple(link(i) for i in np.flatnonzero(keys[:, 1] == process).tolist())
    # shadows: destination tensors here that take direct remote bytes or that this process relays from
    is_shadow = np.zeros(len(plan.dst_tensors), dtype=bool)
    if staged:
        is_shadow[part.relay_sources] = True
        for lk in incoming:
            is_shadow[o["dst_tensor"][np.setdiff1d(lk.ops, lk.buffered_ops, assume_unique=True)]] = True
    shadow = tuple(np.flatnonzero(is_shadow).tolist())
    arena, top = _arena(plan, shadow, incoming, outgoing)
    pack, arrive, to_dst = _buffer_programs(part, incoming, outgoing, is_shadow, staged)
    local, deferred = part.local_copies(is_shadow, ~is_shadow if staged else None)
    commit = Copies.concat([to_dst, part.commit(is_shadow), deferred]) if staged else Copies.empty()
    exposed: set[tuple[int, int]] = set()
    for lk in incoming + outgoing:
        side = "recv" if lk.receiver == process else "send"
        exposed |= set(zip(lk.pieces[f"{side}_kind"].tolist(), lk.pieces[f"{side}_id"].tolist()))
    return LinkSchedule(process=process, direction=choose_direction(plan, binding, options.direction),
                        staged=staged, num_stages=plan.num_stages, incoming=incoming, outgoing=outgoing, pack=pack,
                        arrive=arrive, local=tuple(local), commit=commit, shadow=shadow, arena=arena, arena_numel=top,
                        exposed=tuple(sorted(exposed)), part=part)


def _link(plan: Plan, lid: int, key: np.ndarray, ops: np.ndarray, options: NixlOptions, pack_below: int,
          land_below: int) -> Link:
    """Link `lid` of (stage, sender, receiver) `key` moving `ops`: which ops to pack and land, then its pieces."""
    o, staged = plan.ops, options.staged
    numel_of = o["rows"] * o["cols"]
    if options.pack in ("always", "never"):
        pack_it = np.full(len(ops), options.pack == "always")
    else:  # a contiguous op is one piece (rows == 1), a strided block's are its rows
        pack_it = o["cols"][ops] * plan.itemsize < pack_below
        if int(o["rows"][ops[pack_it]].sum()) < 2:  # one small piece: packing saves no descriptor
            pack_it[:] = False
    packed_ops, direct_ops = ops[pack_it], ops[~pack_it]
    packed_numel = int(numel_of[packed_ops].sum())
    land_it = _landed(plan, direct_ops, land_below) if options.pack != "never" else np.zeros(len(direct_ops), bool)
    landed_ops = direct_ops[land_it]
    pieces = row_pieces(plan, direct_ops[~land_it], staged)
    n_direct = (len(pieces["numel"]) + len(row_pieces(plan, landed_ops, staged)["numel"])
                + int(o["rows"][packed_ops].sum()))  # before coalescing the packed ones
    landed = row_pieces(plan, landed_ops, staged, lid, packed_numel)
    packed = dict(zip(PIECE_COLUMNS, (WIRE, lid, 0, WIRE, lid, 0, packed_numel)))  # the packed buffer's one piece
    pieces = {k: np.concatenate([pieces[k], landed[k], np.asarray([packed[k]] if packed_numel else [], np.int64)])
              for k in PIECE_COLUMNS}
    stage, sender, receiver = (int(x) for x in key)
    return Link(lid, stage, sender, receiver, ops, int(numel_of[ops].sum()), packed_ops, packed_numel, pieces,
                n_direct, landed_ops, int(numel_of[landed_ops].sum()))


def _arena(plan: Plan, shadow: tuple[int, ...], incoming: tuple[Link, ...], outgoing: tuple[Link, ...]) \
        -> tuple[dict[tuple[int, int], tuple[int, int]], int]:
    """(kind, id) -> (element offset, numel) in one arena: shadows, then send buffers, then receive buffers."""
    regions = {(SHADOW, t): int(np.prod(plan.dst_tensors.shapes[t])) for t in shadow}
    regions.update({(WIRE, lk.id): lk.packed_numel for lk in outgoing if lk.packed})
    regions.update({(WIRE, lk.id): lk.recv_numel for lk in incoming if lk.recv_numel})
    starts, top = carve(list(regions.values()), max(1, ARENA_ALIGN_BYTES // plan.itemsize))
    return {k: (a, n) for (k, n), a in zip(regions.items(), starts)}, top


def _buffer_programs(part: Partition, incoming: tuple[Link, ...], outgoing: tuple[Link, ...], is_shadow: np.ndarray,
                     staged: bool) -> tuple[dict[int, Copies], dict[int, Copies], Copies]:
    """Pack programs of outgoing packed links, scatter programs of incoming ones run as each arrives, and the
    scatters into unshadowed tensors that a staged refit defers to its commit."""
    plan = part.plan
    o = plan.ops
    numel_of = o["rows"] * o["cols"]
    pack: dict[int, Copies] = {}
    arrive: dict[int, Copies] = {}
    later: list[dict[str, np.ndarray]] = []
    for lk in outgoing:
        if lk.packed:
            ops = lk.packed_ops
            offs = np.cumsum(numel_of[ops]) - numel_of[ops]
            pack[lk.id] = fold(**_wire_copies(plan, ops, part.read_kind(ops, is_shadow), lk.id, offs, True))
    for lk in incoming:
        if lk.recv_numel:
            ops = lk.buffered_ops
            offs = np.cumsum(numel_of[ops]) - numel_of[ops]
            into = is_shadow[o["dst_tensor"][ops]] | (not staged)
            arrive[lk.id] = fold(**_wire_copies(plan, ops[into], SHADOW if staged else DST, lk.id, offs[into], False))
            later.append(_wire_copies(plan, ops[~into], DST, lk.id, offs[~into], False))
    return pack, arrive, (fold(**{c: np.concatenate([p[c] for p in later]) for c in BLOCK_COLUMNS}) if later
                          else Copies.empty())
