"""The wire schedule of a plan under a binding: messages, rounds and copy programs, as plain arrays.

Pure numpy, no torch and no processes: every process computes the same global numbering from the same plan,
binding and bucket size, and keeps only its own part (`build_schedule`).

1. Each op gets a sending process (the binding's process for its source rank, or for its relaying
   destination rank) and a receiving process. Ops whose two processes are one are LOCAL copies: no
   self-send.
2. The remote ops of one (stage, sender, receiver) form a stream, in plan order; the stream's bytes laid end
   to end are the contiguous wire between those two processes in that stage.
3. A stream is cut into buckets of at most `bucket_numel` elements (`bucket_sizes`: a short ramp up and down
   around full buckets). Bucket k of stage s travels in global round `round_base[s] + k`, where round_base
   counts the buckets of the longest stream of every earlier stage. Rounds are numbered the same on every
   process.
4. Messages: a bucket is one message, except that both ends of every run of at least `direct_numel` elements
   that is contiguous in the sender's (receiver's) memory cut it further, so that such a run travels as
   messages of its own. An op that straddles a cut is split there (rows, then a partial row), so both sides
   agree on where each byte is. A round may so carry several messages between one pair; they share the
   pair's wire buffer (each at its `offset`) and are posted in the same order on both sides.
5. A message's pack program (on the sender) copies source blocks into the wire buffer; its scatter program
   (on the receiver) copies the wire buffer into destination blocks. Both are folded (executors.copies). A
   program that is one contiguous copy of the whole message is not run: the message is sent from (received
   into) that memory directly (`Message.contiguous`). That saves the pack and scatter copies where they, not
   the link, are the limit; refits that NCCL itself limits gain nothing (BENCHMARKS.md, NCCL: direct messages).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ExecutionError
from ..planner import Plan
from ..planner.plan import RELAY, SOURCE
from .binding import Binding
from .copies import DST, SHADOW, SRC, WIRE, Copies, fold


@dataclass(frozen=True, eq=False)
class Message:
    round: int  # global round
    stage: int
    peer: int  # the other process (group rank)
    numel: int  # elements on the wire
    copies: Copies  # pack program on the sender, scatter program on the receiver
    offset: int = 0  # elements into the round's wire buffer of this peer (a round may carry several messages)
    tag: int = 0  # the same on both sides and unique in the schedule (gloo matches messages by tag)

    def contiguous(self) -> tuple[int, int, int] | None:
        """(kind, id, offset) when the program is one contiguous copy of the whole message: the message can
        then be sent from (or received into) that memory directly, with no pack (scatter) copy."""
        c = self.copies.cols
        if len(self.copies) != 1 or int(c["n"][0]) != 1 or int(c["rows"][0]) != 1 or int(c["cols"][0]) != self.numel:
            return None
        side = "dst" if int(c["src_kind"][0]) == WIRE else "src"  # the memory side, not the wire side
        wire = "src" if side == "dst" else "dst"
        if int(c[f"{wire}_off"][0]) != 0:
            return None
        return int(c[f"{side}_kind"][0]), int(c[f"{side}_id"][0]), int(c[f"{side}_off"][0])


@dataclass(frozen=True, eq=False)
class Round:
    index: int
    stage: int
    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]


@dataclass(frozen=True, eq=False)
class RoundSchedule:
    """What one process does, in order.

    rounds: its rounds in global order (only those where it sends or receives);
    local: per stage, local copies run while the refit is in flight (into shadows when staged);
    deferred: local copies that a staged or undo refit runs at commit, straight into the destination tensors
        (into tensors that receive nothing from a peer: they need neither a shadow nor a backup);
    commit: shadow -> destination copies of a staged refit;
    shadow: destination tensor ids that get a staging copy (staged) or a copy of their previous bytes (undo).
    """

    process: int
    bucket_numel: int
    staged: bool
    undo: bool
    num_stages: int
    rounds: tuple[Round, ...]
    local: tuple[Copies, ...]
    deferred: Copies
    commit: Copies
    shadow: tuple[int, ...]
    src_ids: tuple[int, ...]  # source tensor ids this process provides
    dst_ids: tuple[int, ...]  # destination tensor ids this process provides
    sent: dict[int, int]  # peer -> elements sent
    received: dict[int, int]  # peer -> elements received
    local_numel: int
    buffers_per_round: int  # most wire buffers in one round: peers sent to + peers received from


def _senders_receivers(plan: Plan, binding: Binding) -> tuple[np.ndarray, np.ndarray]:
    o = plan.ops
    bsrc, bdst = np.asarray(binding.src, np.int64), np.asarray(binding.dst, np.int64)
    if not plan.num_ops:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    sender = np.where(o["src_side"] == SOURCE, bsrc[np.minimum(o["src_rank"], len(bsrc) - 1)],
                      bdst[np.minimum(o["src_rank"], len(bdst) - 1)])
    return sender, bdst[o["dst_rank"]]


def max_streams_per_process(plan: Plan, binding: Binding) -> int:
    """The most streams (peers it sends to plus peers it receives from) any process has in one stage."""
    sender, receiver = _senders_receivers(plan, binding)
    remote = sender != receiver
    if not remote.any():
        return 0
    st = plan.ops["stage"][remote]
    pairs = np.unique(np.stack([st, sender[remote], receiver[remote]], axis=1), axis=0)
    per = np.concatenate([pairs[:, [0, 1]], pairs[:, [0, 2]]])
    _, counts = np.unique(per, axis=0, return_counts=True)
    return int(counts.max())


def bucket_numel_for(plan: Plan, binding: Binding, memory_cap: int, bucket_bytes: int | None,
                     depth: int) -> int:
    """The bucket size every process uses: wire buffers for `depth` rounds in flight fit `memory_cap` bytes
    on the busiest process, and no bucket exceeds `bucket_bytes`. Rounded to 256 bytes when large."""
    itemsize = plan.itemsize
    streams = max(max_streams_per_process(plan, binding), 1)
    cap = memory_cap // (depth * streams)
    if bucket_bytes is not None:
        cap = min(cap, bucket_bytes)
    if cap < itemsize:
        raise ExecutionError(f"memory_cap={memory_cap} bytes cannot hold {depth * streams} wire buffers of even "
                             f"one element ({depth} rounds in flight x {streams} peers in a round)")
    if cap >= 4096:
        cap -= cap % 256  # keep every wire buffer 256-byte aligned
    return cap // itemsize


def bucket_sizes(length: int, bucket: int) -> list[int]:
    """How a stream of `length` elements is cut into messages: sizes ramp up from bucket/16 (doubling) to
    `bucket` and back down at the end, so the first pack and the last scatter, which nothing overlaps, are
    short, while most bytes travel in full buckets."""
    ramp = [bucket >> j for j in (4, 3, 2, 1) if 0 < bucket >> j < bucket]
    middle = length - 2 * sum(ramp)
    if middle >= 0:
        full, rest = divmod(middle, bucket)
        return ramp + [bucket] * full + ([rest] if rest else []) + ramp[::-1]
    sizes, left = [], length
    for size in ramp + [bucket] * (length // bucket + 1):
        if left <= 0:
            break
        sizes.append(min(size, left))
        left -= size
    return sizes


def _split(p: dict[str, np.ndarray], cuts: np.ndarray) -> dict[str, np.ndarray]:
    """Split blocks at the cut positions (sorted wire positions; key 'w' = a block's first element on the
    wire). A block that straddles a cut becomes: whole rows before it, a partial row up to it, the rest of
    that row after it, and the remaining rows."""
    done = []
    while len(p["w"]):
        numel = p["rows"] * p["cols"]
        cut_at = cuts[np.minimum(np.searchsorted(cuts, p["w"], side="right"), len(cuts) - 1)]
        cross = p["w"] + numel > cut_at
        done.append({k: v[~cross] for k, v in p.items()})
        if not cross.any():
            break
        x = {k: v[cross] for k, v in p.items()}
        cut = cut_at[cross] - x["w"]
        r, c = np.divmod(cut, x["cols"])

        def piece(mask, row0, col0, rows, cols):
            return {**{k: v[mask] for k, v in x.items()},
                    "so": (x["so"] + row0 * x["ss"] + col0)[mask], "do": (x["do"] + row0 * x["ds"] + col0)[mask],
                    "w": (x["w"] + row0 * x["cols"] + col0)[mask], "rows": rows[mask], "cols": cols[mask]}

        one = np.ones_like(r)
        zero = np.zeros_like(r)
        done.append(piece(r > 0, zero, zero, r, x["cols"]))  # whole rows before the cut
        done.append(piece(c > 0, r, zero, one, c))  # partial row up to the cut
        after_row = r + (c > 0)
        p = {k: np.concatenate([a, b]) for (k, a), b in zip(
            piece(c > 0, r, c, one, x["cols"] - c).items(),  # rest of the cut row
            piece(x["rows"] > after_row, after_row, zero, x["rows"] - after_row, x["cols"]).values())}
    return {k: np.concatenate([d[k] for d in done]) for k in done[0]}


LANES_DIRECT_BYTES = 16 << 20  # the same with several lanes, where messages are cheap (executors.lanes)
DIRECT_BYTES = 64 << 20  # runs contiguous in one side's memory at least this long travel unpacked
# gloo over loopback or TCP: a message costs little next to a CPU copy; sending tensors as they are beat packing
# them (BENCHMARKS.md, Same host: the gloo row of the CPU `refit_shared.py` run)
GLOO_DIRECT_BYTES = 64 << 10


def build_schedule(plan: Plan, binding: Binding, process: int, bucket_numel: int, staged: bool,
                   direct_numel: int | None = None, undo: bool = False) -> RoundSchedule:
    """The part of the global schedule that `process` (a group rank) runs. `direct_numel`: the shortest run
    contiguous in the sender's memory that travels as messages of its own (default DIRECT_BYTES). `undo`
    (not with `staged`): writes go straight into the destination tensors, and every destination tensor this
    process writes gets a shadow that holds its previous bytes (the executor backs each region up just before
    writing it, and restores it if the refit fails)."""
    if direct_numel is None:
        direct_numel = max(DIRECT_BYTES // plan.itemsize, 1)
    if bucket_numel < 1:
        raise ExecutionError(f"bucket_numel={bucket_numel} must be at least 1")
    if undo and staged:
        raise ExecutionError("undo and staged are two ways of keeping the previous weights; choose one")
    binding.check(plan.src.num_ranks, plan.dst.num_ranks)
    o = plan.ops
    sender, receiver = _senders_receivers(plan, binding)
    numel = o["rows"] * o["cols"]
    remote = sender != receiver
    num_stages = plan.num_stages

    # streams and global rounds (the same on every process)
    r_idx = np.flatnonzero(remote)
    order = r_idx[np.lexsort((r_idx, receiver[r_idx], sender[r_idx], o["stage"][r_idx]))]
    skey = np.stack([o["stage"][order], sender[order], receiver[order]], axis=1)
    if len(order):
        new = np.ones(len(order), dtype=bool)
        new[1:] = np.any(skey[1:] != skey[:-1], axis=1)
        stream = np.cumsum(new) - 1
        first = np.flatnonzero(new)
        ends = np.cumsum(numel[order])
        starts_of_stream = np.concatenate([[0], ends[first[1:] - 1]])
        stream_numel = np.diff(np.concatenate([starts_of_stream, [ends[-1]]]))
        stream_stage = skey[first, 0]
        w = ends - numel[order]  # each op's first element on one wire that lays the streams end to end
        # round boundaries: every stream cut into buckets, as positions on that one wire
        sizes = [bucket_sizes(int(n), bucket_numel) for n in stream_numel.tolist()]
        buckets = np.asarray([len(x) for x in sizes], dtype=np.int64)
        bcuts = np.cumsum(np.concatenate([[0], *[np.asarray(x, np.int64) for x in sizes]]))
        stream_first_bucket = np.concatenate([[0], np.cumsum(buckets)[:-1]])
        # message boundaries: the round boundaries, plus both ends of every long run that is contiguous in the
        # sender's (receiver's) memory, so that such a run travels as messages of its own, sent from (received
        # into) that memory with no pack (scatter) copy
        cuts = [bcuts]
        for side in ("src", "dst"):
            runs = _runs(o, order, new, numel[order], side)
            run_numel = np.add.reduceat(numel[order], runs)
            long = run_numel >= direct_numel
            cuts += [w[runs[long]], w[runs[long]] + run_numel[long]]
        cuts = np.unique(np.concatenate(cuts))
        per_stage = np.zeros(max(num_stages, 1), np.int64)
        np.maximum.at(per_stage, stream_stage, buckets)
    else:
        stream = w = np.zeros(0, np.int64)
        stream_stage = stream_first_bucket = np.zeros(0, np.int64)
        cuts = bcuts = np.zeros(1, np.int64)
        per_stage = np.zeros(max(num_stages, 1), np.int64)
    round_base = np.concatenate([[0], np.cumsum(per_stage)[:-1]])

    # this process's messages
    mine = (skey[:, 1] == process) | (skey[:, 2] == process) if len(order) else np.zeros(0, bool)
    sel = order[mine]
    relay_read = np.zeros(len(plan.dst_tensors), dtype=bool)  # destination tensors this process relays from
    relay_read[o["src_tensor"][(sender == process) & (o["src_side"] == RELAY)]] = True
    pieces = _split({
        "op": sel, "stream": stream[mine], "w": w[mine],
        "so": o["src_offset"][sel], "ss": o["src_stride"][sel], "do": o["dst_offset"][sel],
        "ds": o["dst_stride"][sel], "rows": o["rows"][sel], "cols": o["cols"][sel],
    }, cuts) if len(sel) else None

    # tensors written while the refit is in flight when it is staged or undone: those that receive bytes from
    # a peer or that this process forwards from; local copies into any other tensor wait for the commit
    in_flight_tensor = relay_read.copy()
    if pieces is not None:
        in_flight_tensor[o["dst_tensor"][pieces["op"][receiver[pieces["op"]] == process]]] = True
    shadowed = in_flight_tensor if staged else np.zeros(len(plan.dst_tensors), dtype=bool)  # staged writes land here
    backed_up = in_flight_tensor if undo else np.zeros(len(plan.dst_tensors), dtype=bool)  # undo keeps these
    dst_kind = lambda tid: np.where(shadowed[tid], SHADOW, DST)  # noqa: E731 - where a write lands in flight

    rounds: dict[int, dict[str, list[Message]]] = {}
    sent: dict[int, int] = {}
    received: dict[int, int] = {}
    if pieces is not None:
        op = pieces["op"]
        st = pieces["stream"]
        cut = np.searchsorted(cuts, pieces["w"], side="right") - 1  # the piece's message, as its first cut
        wire_off = pieces["w"] - cuts[cut]
        msg_ids, msg_of = np.unique(cut, return_inverse=True)
        msg_of = msg_of.reshape(-1)
        m_stream = np.zeros(len(msg_ids), np.int64)
        m_stream[msg_of] = st
        m_bucket = np.searchsorted(bcuts, cuts[msg_ids], side="right") - 1
        m_k = m_bucket - stream_first_bucket[m_stream]  # bucket (round) index inside the stream
        m_offset = cuts[msg_ids] - bcuts[m_bucket]  # where the message sits in its round's wire buffer
        m_numel = cuts[msg_ids + 1] - cuts[msg_ids]
        is_send = sender[op] == process
        side = o["src_side"][op]
        src_kind = _read_kind(side, o["src_tensor"][op], shadowed)
        pack = fold(src_kind[is_send], o["src_tensor"][op][is_send], pieces["so"][is_send], pieces["ss"][is_send],
                    WIRE, msg_of[is_send], wire_off[is_send], pieces["cols"][is_send],
                    pieces["rows"][is_send], pieces["cols"][is_send])
        rv = ~is_send
        d_t = o["dst_tensor"][op][rv]
        scatter = fold(WIRE, msg_of[rv], wire_off[rv], pieces["cols"][rv], dst_kind(d_t), d_t, pieces["do"][rv],
                       pieces["ds"][rv], pieces["rows"][rv], pieces["cols"][rv])
        msg_send = np.zeros(len(msg_ids), dtype=bool)
        msg_send[msg_of[is_send]] = True
        by_msg = {}
        for prog, col in ((pack, "dst_id"), (scatter, "src_id")):
            ids = prog.cols[col]
            srt = np.argsort(ids, kind="stable")
            bounds = np.searchsorted(ids[srt], np.arange(len(msg_ids) + 1))
            for m in np.unique(ids).tolist():
                part = prog.select(srt[bounds[m]:bounds[m + 1]])
                by_msg[m] = Copies({**part.cols, col: np.zeros(len(part), np.int64)})  # WIRE 0: its own buffer
        for m in range(len(msg_ids)):
            s_ = int(m_stream[m])
            stage = int(stream_stage[s_])
            rnd = int(round_base[stage]) + int(m_k[m])
            peer = int(skey[first[s_], 2] if msg_send[m] else skey[first[s_], 1])
            n = int(m_numel[m])
            entry = rounds.setdefault(rnd, {"stage": stage, "sends": [], "recvs": []})
            entry["sends" if msg_send[m] else "recvs"].append(
                Message(rnd, stage, peer, n, by_msg[m], int(m_offset[m]), int(msg_ids[m])))
            book = sent if msg_send[m] else received
            book[peer] = book.get(peer, 0) + n
    in_order = lambda ms: tuple(sorted(ms, key=lambda m: (m.peer, m.offset)))  # noqa: E731 - both sides agree
    round_list = tuple(Round(r, e["stage"], in_order(e["sends"]), in_order(e["recvs"]))
                       for r, e in sorted(rounds.items()))

    # local copies
    loc = np.flatnonzero(~remote & (receiver == process))
    side = o["src_side"][loc]
    s_kind = _read_kind(side, o["src_tensor"][loc], shadowed)
    d_t = o["dst_tensor"][loc]
    in_flight = in_flight_tensor[d_t] | (not (staged or undo))  # the rest waits for the commit
    local = []
    for stage in range(num_stages):
        m = in_flight & (o["stage"][loc] == stage)
        local.append(_fold_ops(o, loc[m], s_kind[m], dst_kind(d_t[m])))
    deferred = _fold_ops(o, loc[~in_flight], s_kind[~in_flight], DST)

    # commit: every region written into a shadow goes to the destination tensor; a tensor written whole is
    # one contiguous copy
    commit = Copies.empty()
    if staged and shadowed.any():
        w_ops = np.concatenate([pieces["op"][receiver[pieces["op"]] == process] if pieces is not None
                                else np.zeros(0, np.int64), loc[in_flight]])
        w_ops = np.unique(w_ops)
        t = o["dst_tensor"][w_ops]
        sizes = np.asarray([int(np.prod(s)) for s in plan.dst_tensors.shapes], dtype=np.int64)
        written = np.bincount(t, weights=numel[w_ops], minlength=len(sizes)).astype(np.int64)
        whole = shadowed & (written == sizes)
        part = ~whole[t]
        ids = np.flatnonzero(whole)
        commit = Copies.concat([
            fold(SHADOW, ids, 0, sizes[ids], DST, ids, 0, sizes[ids], 1, sizes[ids]) if len(ids) else Copies.empty(),
            fold(SHADOW, t[part], o["dst_offset"][w_ops][part], o["dst_stride"][w_ops][part], DST, t[part],
                 o["dst_offset"][w_ops][part], o["dst_stride"][w_ops][part], o["rows"][w_ops][part],
                 o["cols"][w_ops][part]) if part.any() else Copies.empty(),
        ])

    per_round = max((len({m.peer for m in r.sends}) + len({m.peer for m in r.recvs}) for r in round_list),
                    default=0)
    src_ids = tuple(i for i, r in enumerate(plan.src_tensors.ranks) if binding.src[r] == process)
    dst_ids = tuple(i for i, r in enumerate(plan.dst_tensors.ranks) if binding.dst[r] == process)
    return RoundSchedule(
        process=process, bucket_numel=bucket_numel, staged=staged, num_stages=num_stages, rounds=round_list,
        local=tuple(local), deferred=deferred, commit=commit,
        shadow=tuple(np.flatnonzero(shadowed | backed_up).tolist()), undo=undo,
        src_ids=src_ids, dst_ids=dst_ids, sent=sent, received=received, local_numel=int(numel[loc].sum()),
        buffers_per_round=per_round)


def _runs(o: dict[str, np.ndarray], order: np.ndarray, new_stream: np.ndarray, numel: np.ndarray,
          side: str) -> np.ndarray:
    """Where runs start, as positions in `order`: a run is a longest chain of a stream's ops, each contiguous in
    one side's memory (side "src" or "dst") and starting there where the previous one ends."""
    rows, cols = o["rows"][order], o["cols"][order]
    contiguous = (rows == 1) | (cols == o[f"{side}_stride"][order])
    off, tensor = o[f"{side}_offset"][order], o[f"{side}_tensor"][order]
    kind = o["src_side"][order] if side == "src" else np.zeros(len(order), np.int64)
    chain = np.zeros(len(order), dtype=bool)
    chain[1:] = (~new_stream[1:] & contiguous[1:] & contiguous[:-1] & (kind[1:] == kind[:-1])
                 & (tensor[1:] == tensor[:-1]) & (off[1:] == off[:-1] + numel[:-1]))
    return np.flatnonzero(~chain)


def _read_kind(side: np.ndarray, tensor: np.ndarray, shadowed: np.ndarray) -> np.ndarray:
    """SRC for source ops; for relays, the destination tensor's shadow when it has one."""
    kind = np.full(len(side), SRC, dtype=np.int64)
    relay = side == RELAY
    kind[relay] = np.where(shadowed[tensor[relay]], SHADOW, DST)
    return kind


def _fold_ops(o: dict[str, np.ndarray], idx: np.ndarray, src_kind, dst_kind) -> Copies:
    if not len(idx):
        return Copies.empty()
    return fold(src_kind, o["src_tensor"][idx], o["src_offset"][idx], o["src_stride"][idx], dst_kind,
                o["dst_tensor"][idx], o["dst_offset"][idx], o["dst_stride"][idx], o["rows"][idx], o["cols"][idx])
