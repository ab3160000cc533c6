"""One process's part of a plan over NIXL, as plain arrays: links, descriptor pieces, copy programs, staging.

Pure numpy, no NIXL and no torch: every process derives the same global link numbering from the same plan and
binding, so both ends of a link build the same pieces without asking each other.

1. Each op gets a sending process (the binding's process for its source rank, or for its relaying destination
   rank) and a receiving process. Ops whose two processes are one are LOCAL copies.
2. The remote ops of one (stage, sender, receiver) form a LINK, numbered globally in that sort order. A link is
   one NIXL transfer, prepared once and re-posted at every refit.
3. An op of a link moves DIRECT, as one descriptor per contiguous piece (a strided block is one piece per row;
   pieces adjacent on both sides are coalesced), or PACKED: the sender gathers the link's packed ops into a
   send buffer, one descriptor moves them into a receive buffer, and the receiver scatters them. An op is
   packed when its pieces are small (below options.pack_below bytes) and the link has more than one such
   piece: there a descriptor costs more than copying the bytes twice. A run of ops that is contiguous in the
   sender's memory but falls apart into many short pieces on the receiver (the q / k / v blocks of one fused
   QKV weight) is LANDED: one descriptor moves the whole run into the receive buffer, and the receiver
   scatters it (one copy instead of a descriptor per piece). So a link is a few large descriptors (big
   contiguous runs) plus at most one for all its small pieces.
4. Staging (options.staged): a destination tensor that receives DIRECT bytes from a peer, or that this
   process forwards from (a relay source), gets a SHADOW in the staging arena; every write bound for it lands
   in the shadow and the commit copies the shadow into the tensor. Everything else bound for a destination
   tensor (packed receive buffers, local copies) is applied at commit. In place, everything goes straight to
   the destination tensors as it arrives.

Memory is named by (kind, id) as in every executor (executors.copies): SRC / DST the caller's tensors, SHADOW
a staging copy of a destination tensor, WIRE a link's packed buffer (id = link id: the send buffer on the
sender, the receive buffer on the receiver). SHADOW and WIRE live in one arena per process. Offsets and
lengths are in elements of the plan's dtype. Copy programs are folded (executors.copies) once, here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...errors import ExecutionError
from ...planner import Plan
from ...planner.plan import RELAY
from ..binding import Binding
from ..copies import DST, SHADOW, SRC, WIRE, Copies, fold
from .options import NixlOptions

BLOCK_COLUMNS = ("src_kind", "src_id", "src_off", "src_stride", "dst_kind", "dst_id", "dst_off", "dst_stride",
                 "rows", "cols")  # the arguments of `fold`
PIECE_COLUMNS = ("send_kind", "send_id", "send_off", "recv_kind", "recv_id", "recv_off", "numel")
ARENA_ALIGN_BYTES = 512


def _i64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.int64)


def _blocks(n: int, **cols) -> dict[str, np.ndarray]:
    """2-D block copies as `fold`'s columns (scalars broadcast to n): copy k moves `rows` x `cols` elements from
    (src_kind, src_id) at src_off, rows src_stride apart, to (dst_kind, dst_id) at dst_off, rows dst_stride
    apart."""
    return {c: np.broadcast_to(_i64(cols[c]), (n,)) for c in BLOCK_COLUMNS}


def _fold(parts: list[dict[str, np.ndarray]]) -> Copies:
    """The blocks of several parts as one folded program."""
    return fold(**{c: np.concatenate([p[c] for p in parts] or [_i64([])]) for c in BLOCK_COLUMNS})


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
        return self.packed_numel > 0

    @property
    def num_pieces(self) -> int:
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
    itemsize: int
    incoming: tuple[Link, ...]
    outgoing: tuple[Link, ...]
    pack: dict[int, Copies]  # outgoing packed link -> gather into its send buffer
    arrive: dict[int, Copies]  # incoming packed link -> scatter run as soon as it has arrived
    local: tuple[Copies, ...]  # per stage, run while the refit is in flight
    commit: Copies  # run after every process verified its refit (staged only)
    shadow: tuple[int, ...]  # destination tensor ids with a shadow
    arena: dict[tuple[int, int], tuple[int, int]]  # (kind, id) -> (element offset, numel)
    arena_numel: int
    src_ids: tuple[int, ...]  # source tensor ids this process must hold
    dst_ids: tuple[int, ...]  # destination tensor ids this process must hold
    local_numel: int = 0  # elements copied between ranks of this process
    exposed: tuple[tuple[int, int], ...] = field(default=())  # memories whose addresses peers need
    peers: tuple[int, ...] = field(default=())

    @property
    def links(self) -> tuple[Link, ...]:
        return self.incoming + self.outgoing

    def initiates(self, link: Link) -> bool:
        return (link.receiver if self.direction == "read" else link.sender) == self.process

    @property
    def staging_bytes(self) -> int:
        return self.arena_numel * self.itemsize


def op_processes(plan: Plan, binding: Binding) -> tuple[np.ndarray, np.ndarray]:
    """Sending and receiving process of every op."""
    binding.check(plan.src.num_ranks, plan.dst.num_ranks)
    o = plan.ops
    src_proc, dst_proc = _i64(binding.src), _i64(binding.dst)
    if not plan.num_ops:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    relay = o["src_side"] == RELAY
    sender = np.empty(plan.num_ops, np.int64)
    sender[~relay] = src_proc[o["src_rank"][~relay]]
    sender[relay] = dst_proc[o["src_rank"][relay]]  # a relay's sender is a destination rank
    return sender, dst_proc[o["dst_rank"]]


def global_links(plan: Plan, binding: Binding) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(link id per op, -1 for local ops; stage, sender, receiver per link), the same on every process."""
    sender, receiver = op_processes(plan, binding)
    stage = plan.ops["stage"]
    remote = sender != receiver
    link_of_op = np.full(plan.num_ops, -1, np.int64)
    if not remote.any():
        return link_of_op, *(np.zeros(0, np.int64),) * 3
    keys = np.stack([stage[remote], sender[remote], receiver[remote]], axis=1)
    uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
    link_of_op[remote] = inverse.reshape(-1)
    return link_of_op, uniq[:, 0], uniq[:, 1], uniq[:, 2]


def _relay_sources(plan: Plan, ops: np.ndarray) -> np.ndarray:
    o = plan.ops
    return np.unique(o["src_tensor"][ops[o["src_side"][ops] == RELAY]])


def _sides(plan: Plan, ops: np.ndarray, staged: bool) -> tuple[np.ndarray, np.ndarray]:
    """Memory kind read (source side) and written (destination side) by direct ops, before packing."""
    o = plan.ops
    landing = SHADOW if staged else DST
    read_kind = np.where(o["src_side"][ops] == RELAY, landing, SRC)
    return read_kind, np.full(len(ops), landing, np.int64)


def _expand_rows(plan: Plan, ops: np.ndarray, staged: bool) -> dict[str, np.ndarray]:
    """Contiguous pieces of direct ops (a strided block is one piece per row), in op order, coalesced."""
    o = plan.ops
    rows = o["rows"][ops]
    rep = np.repeat(np.arange(len(ops)), rows)
    first = np.repeat(np.cumsum(rows) - rows, rows)
    r = np.arange(len(rep)) - first
    idx = ops[rep]
    read_kind, write_kind = _sides(plan, ops, staged)
    pieces = {
        "send_kind": read_kind[rep], "send_id": o["src_tensor"][idx],
        "send_off": o["src_offset"][idx] + r * o["src_stride"][idx],
        "recv_kind": write_kind[rep], "recv_id": o["dst_tensor"][idx],
        "recv_off": o["dst_offset"][idx] + r * o["dst_stride"][idx],
        "numel": o["cols"][idx],
    }
    return coalesce(pieces)


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


def _landed(plan: Plan, ops: np.ndarray, land_below: int) -> np.ndarray:
    """Which direct ops to land: runs of ops contiguous in the sender's memory, one after the other, whose pieces
    on the receiver are many and short on average. Such a run moves as ONE descriptor into the receive buffer
    and is scattered from there: one local copy instead of a descriptor per piece."""
    if len(ops) < 2:
        return np.zeros(len(ops), dtype=bool)
    o = plan.ops
    rows, cols = o["rows"][ops], o["cols"][ops]
    numel = rows * cols
    src_flat = (rows == 1) | (cols == o["src_stride"][ops])
    off, tensor, side = o["src_offset"][ops], o["src_tensor"][ops], o["src_side"][ops]
    chain = np.zeros(len(ops), dtype=bool)
    chain[1:] = (src_flat[1:] & src_flat[:-1] & (side[1:] == side[:-1]) & (tensor[1:] == tensor[:-1])
                 & (off[1:] == off[:-1] + numel[:-1]))
    run = np.cumsum(~chain) - 1
    dst_flat = (rows == 1) | (cols == o["dst_stride"][ops])
    pieces = np.bincount(run, weights=np.where(dst_flat, 1, rows)).astype(np.int64)  # before coalescing
    run_numel = np.bincount(run, weights=numel).astype(np.int64)
    land = (pieces >= 2) & (run_numel * plan.itemsize < land_below * pieces)
    return land[run] & src_flat


def _landed_pieces(plan: Plan, ops: np.ndarray, staged: bool, link: int, base: int) -> dict[str, np.ndarray]:
    """One piece per sender-contiguous run of landed ops, into the receive buffer after `base` elements."""
    o = plan.ops
    numel = o["rows"][ops] * o["cols"][ops]
    read_kind, _ = _sides(plan, ops, staged)
    pieces = {"send_kind": read_kind, "send_id": o["src_tensor"][ops], "send_off": o["src_offset"][ops],
              "recv_kind": np.full(len(ops), WIRE, np.int64), "recv_id": np.full(len(ops), link, np.int64),
              "recv_off": base + np.cumsum(numel) - numel, "numel": numel}
    return coalesce(pieces)


def _block_copies(plan: Plan, ops: np.ndarray, src_kind, dst_kind, dst_id=None, dst_off=None) \
        -> dict[str, np.ndarray]:
    """Copies of ops from their source memory to their destination tensor's memory (or to a packed buffer:
    dst_id / dst_off given, rows laid out contiguously)."""
    o = plan.ops
    n = len(ops)
    rows, cols = o["rows"][ops], o["cols"][ops]
    packed = dst_off is not None
    return _blocks(n, src_kind=src_kind, src_id=o["src_tensor"][ops], src_off=o["src_offset"][ops],
                   src_stride=o["src_stride"][ops], dst_kind=dst_kind,
                   dst_id=dst_id if packed else o["dst_tensor"][ops],
                   dst_off=dst_off if packed else o["dst_offset"][ops],
                   dst_stride=cols if packed else o["dst_stride"][ops], rows=rows, cols=cols)


def _scatter_copies(plan: Plan, ops: np.ndarray, link: int, offsets: np.ndarray, dst_kind) -> dict[str, np.ndarray]:
    o = plan.ops
    cols = o["cols"][ops]
    return _blocks(len(ops), src_kind=WIRE, src_id=link, src_off=offsets, src_stride=cols, dst_kind=dst_kind,
                   dst_id=o["dst_tensor"][ops], dst_off=o["dst_offset"][ops], dst_stride=o["dst_stride"][ops],
                   rows=o["rows"][ops], cols=cols)


def choose_direction(plan: Plan, binding: Binding, requested: str) -> str:
    """"read" or "write"; "auto" picks the one whose busiest initiator starts the fewest bytes (on CPU the
    initiating process's thread does the copy), READ on a tie."""
    if requested != "auto":
        return requested
    link_of_op, _, senders, receivers = global_links(plan, binding)
    if not len(senders):
        return "read"
    nbytes = np.bincount(link_of_op[link_of_op >= 0], weights=plan.op_bytes()[link_of_op >= 0],
                         minlength=len(senders))
    size = binding.num_processes
    read = np.bincount(receivers, weights=nbytes, minlength=size).max()
    write = np.bincount(senders, weights=nbytes, minlength=size).max()
    return "write" if write < read else "read"


def build_schedule(plan: Plan, binding: Binding, process: int, options: NixlOptions,
                   pack_below: int, land_below: int = 0) -> LinkSchedule:
    """This process's part of the plan (see the module docstring). Ops with pieces below `pack_below` bytes
    are packed; runs whose receiver pieces average below `land_below` bytes are landed."""
    if not 0 <= process < binding.num_processes:
        raise ExecutionError(f"process {process} is outside the binding's processes 0..{binding.num_processes - 1}")
    o = plan.ops
    staged = options.staged
    direction = choose_direction(plan, binding, options.direction)
    sender, receiver = op_processes(plan, binding)
    link_of_op, l_stage, l_send, l_recv = global_links(plan, binding)
    mine_in = np.flatnonzero(l_recv == process)
    mine_out = np.flatnonzero(l_send == process)
    local_ops = np.flatnonzero((sender == process) & (receiver == process))
    recv_ops = np.flatnonzero(receiver == process)
    num_stages = plan.num_stages

    # Shadows: destination tensors here that take direct remote bytes or that this process relays from.
    relays_here = np.flatnonzero((sender == process) & (o["src_side"] == RELAY))
    relay_src = set(_relay_sources(plan, relays_here).tolist())

    # Links (both ends build the same Link): which ops to pack, then the pieces.
    order = np.argsort(link_of_op, kind="stable")
    counts = np.bincount(link_of_op[link_of_op >= 0], minlength=len(l_stage))
    starts = np.concatenate([[0], np.cumsum(counts)]) + int((link_of_op < 0).sum())
    links: dict[int, Link] = {}
    itemsize = plan.itemsize
    numel_of = o["rows"] * o["cols"]
    piece_bytes = o["cols"] * itemsize  # a contiguous op is one piece (rows == 1), a strided block's are its rows
    for lid in np.concatenate([mine_in, mine_out]).tolist():
        ops = np.sort(order[starts[lid]:starts[lid + 1]])
        if options.pack == "always":
            pack_it = np.ones(len(ops), dtype=bool)
        elif options.pack == "never":
            pack_it = np.zeros(len(ops), dtype=bool)
        else:
            pack_it = piece_bytes[ops] < pack_below
            if int(o["rows"][ops[pack_it]].sum()) < 2:  # one small piece: packing saves no descriptor
                pack_it[:] = False
        packed_ops = ops[pack_it]
        packed_numel = int(numel_of[packed_ops].sum())
        direct_ops = ops[~pack_it]
        land_it = _landed(plan, direct_ops, land_below) if options.pack != "never" else \
            np.zeros(len(direct_ops), dtype=bool)
        landed_ops = direct_ops[land_it]
        pieces = _expand_rows(plan, direct_ops[~land_it], staged)
        n_direct = (len(pieces["numel"]) + len(_expand_rows(plan, landed_ops, staged)["numel"])
                    + int(o["rows"][packed_ops].sum()))  # before coalescing the packed ones
        landed = _landed_pieces(plan, landed_ops, staged, lid, packed_numel)
        pieces = {k: np.concatenate([pieces[k], landed[k]]) for k in PIECE_COLUMNS}
        if packed_numel:
            pieces = {k: np.concatenate([pieces[k], _i64([v])])
                      for k, v in zip(PIECE_COLUMNS, (WIRE, lid, 0, WIRE, lid, 0, packed_numel))}
        links[lid] = Link(lid, int(l_stage[lid]), int(l_send[lid]), int(l_recv[lid]), ops,
                          int(numel_of[ops].sum()), packed_ops, packed_numel, pieces, n_direct, landed_ops,
                          int(numel_of[landed_ops].sum()))
    incoming = tuple(links[i] for i in mine_in.tolist())
    outgoing = tuple(links[i] for i in mine_out.tolist())

    shadow: set[int] = set()
    if staged:
        shadow |= relay_src
        for link in incoming:
            direct = np.setdiff1d(link.ops, link.buffered_ops, assume_unique=True)
            shadow |= set(np.unique(o["dst_tensor"][direct]).tolist())
    is_shadow = np.zeros(len(plan.dst_tensors), dtype=bool)
    is_shadow[sorted(shadow)] = True

    # Arena: shadows, then send buffers, then receive buffers.
    arena: dict[tuple[int, int], tuple[int, int]] = {}
    align = max(1, ARENA_ALIGN_BYTES // itemsize)
    top = 0

    def place(key: tuple[int, int], numel: int) -> None:
        nonlocal top
        arena[key] = (top, numel)
        top += -(-max(numel, 1) // align) * align

    for t in sorted(shadow):
        place((SHADOW, t), int(np.prod(plan.dst_tensors.shapes[t])))
    for link in outgoing:
        if link.packed:
            place((WIRE, link.id), link.packed_numel)
    for link in incoming:
        if link.recv_numel:
            place((WIRE, link.id), link.recv_numel)

    landing = SHADOW if staged else DST
    # Pack programs (sender) and scatter programs (receiver) of packed links.
    pack: dict[int, Copies] = {}
    arrive: dict[int, Copies] = {}
    commit_parts: list[dict[str, np.ndarray]] = []
    for link in outgoing:
        if link.packed:
            ops = link.packed_ops
            offs = np.cumsum(numel_of[ops]) - numel_of[ops]
            read_kind = np.where(o["src_side"][ops] == RELAY, landing, SRC)
            pack[link.id] = fold(**_block_copies(plan, ops, read_kind, WIRE, link.id, offs))
    for link in incoming:
        if link.recv_numel:
            ops = link.buffered_ops
            offs = np.cumsum(numel_of[ops]) - numel_of[ops]
            to_shadow = is_shadow[o["dst_tensor"][ops]]
            if staged:
                arrive[link.id] = fold(**_scatter_copies(plan, ops[to_shadow], link.id, offs[to_shadow], SHADOW))
                commit_parts.append(_scatter_copies(plan, ops[~to_shadow], link.id, offs[~to_shadow], DST))
            else:
                arrive[link.id] = fold(**_scatter_copies(plan, ops, link.id, offs, DST))

    # Local copies per stage; a staged refit defers those bound for unshadowed tensors to the commit.
    local: list[Copies] = []
    deferred: list[dict[str, np.ndarray]] = []
    for s in range(num_stages):
        ops = local_ops[o["stage"][local_ops] == s]
        read_kind = np.where(o["src_side"][ops] == RELAY, landing, SRC)
        if staged:
            into = is_shadow[o["dst_tensor"][ops]]
            local.append(fold(**_block_copies(plan, ops[into], read_kind[into], SHADOW)))
            deferred.append(_block_copies(plan, ops[~into], read_kind[~into], DST))
        else:
            local.append(fold(**_block_copies(plan, ops, read_kind, DST)))
    # Commit: each shadow into its tensor (whole when the plan writes all of it, else op by op).
    if staged:
        for t in sorted(shadow):
            ops = recv_ops[o["dst_tensor"][recv_ops] == t]
            size = int(np.prod(plan.dst_tensors.shapes[t]))
            written = int((o["rows"][ops] * o["cols"][ops]).sum())
            if written == size:
                commit_parts.append(_blocks(1, src_kind=SHADOW, src_id=t, src_off=0, src_stride=size,
                                            dst_kind=DST, dst_id=t, dst_off=0, dst_stride=size, rows=1,
                                            cols=size))
            elif len(ops):
                commit_parts.append(_blocks(len(ops), src_kind=SHADOW, src_id=t, src_off=o["dst_offset"][ops],
                                            src_stride=o["dst_stride"][ops], dst_kind=DST, dst_id=t,
                                            dst_off=o["dst_offset"][ops], dst_stride=o["dst_stride"][ops],
                                            rows=o["rows"][ops], cols=o["cols"][ops]))
        commit_parts.extend(deferred)

    # Tensors this process must hold, and the memories peers address.
    sends = np.flatnonzero(sender == process)
    src_ids = np.unique(o["src_tensor"][sends[o["src_side"][sends] != RELAY]])
    dst_ids = np.unique(np.concatenate([o["dst_tensor"][recv_ops], o["src_tensor"][relays_here]]))
    exposed: set[tuple[int, int]] = set()
    for link in incoming + outgoing:
        here = link.receiver == process
        p = link.pieces
        kinds, ids = (p["recv_kind"], p["recv_id"]) if here else (p["send_kind"], p["send_id"])
        exposed |= set(zip(kinds.tolist(), ids.tolist()))
    peers = sorted({link.sender for link in incoming} | {link.receiver for link in outgoing})
    return LinkSchedule(process=process, direction=direction, staged=staged, num_stages=num_stages,
                        itemsize=itemsize, incoming=incoming, outgoing=outgoing, pack=pack, arrive=arrive,
                        local=tuple(local), commit=_fold(commit_parts), shadow=tuple(sorted(shadow)),
                        arena=arena, arena_numel=top, src_ids=tuple(src_ids.tolist()),
                        dst_ids=tuple(dst_ids.tolist()), local_numel=int(numel_of[local_ops].sum()),
                        exposed=tuple(sorted(exposed)), peers=tuple(peers))
