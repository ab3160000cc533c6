"""The wire schedule of a plan under a binding: messages, rounds and copy programs, as plain arrays.

Pure numpy: every process computes the same global numbering and keeps its own part (`build_schedule`).
1. Ops whose sending and receiving processes are one are LOCAL copies; the remote ops of one (stage, sender,
   receiver) form a stream, whose bytes laid end to end are the wire between the pair in that stage.
2. A stream is cut into buckets (`bucket_sizes`); bucket k of stage s travels in global round
   `round_base[s] + k`, round_base counting the longest stream's buckets of every earlier stage.
3. A bucket is one message, except that runs of at least `direct_numel` elements contiguous in one side's memory
   travel as messages of their own; an op straddling a cut is split (rows, then a partial row). A round's
   messages between one pair share the pair's wire buffer (each at its `offset`), posted in one order both sides.
4. A message's folded pack (sender) and scatter (receiver) programs copy between tensors and the wire buffer; a
   program that is one contiguous copy is not run: the message uses that memory directly (`Message.contiguous`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import ExecutionError
from ...planner import Plan
from ..binding import Binding
from ..copies import DST, SHADOW, WIRE, Copies, fold
from ..partition import Partition


@dataclass(frozen=True, eq=False)
class Message:
    """One point-to-point message of a round: its peer, size, place in the round's wire buffer and the copies
    that pack (sender) or scatter (receiver) it."""

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
    """The messages one process sends and receives in one round of a stage."""

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
    shadow: destination tensor ids that get a staging copy (staged) or a copy of their previous bytes (undo);
    part: the partition it is cut from (the process, its tensor ids, the elements it sends, receives, copies).
    """

    part: Partition
    bucket_numel: int
    staged: bool
    undo: bool
    num_stages: int
    rounds: tuple[Round, ...]
    local: tuple[Copies, ...]
    deferred: Copies
    commit: Copies
    shadow: tuple[int, ...]
    buffers_per_round: int  # most wire buffers in one round: peers sent to + peers received from


def bucket_numel_for(plan: Plan, binding: Binding, memory_cap: int, bucket_bytes: int | None,
                     depth: int) -> int:
    """The bucket size (elements) of every process: `depth` rounds of wire buffers fit `memory_cap` bytes on the
    busiest process and no bucket exceeds `bucket_bytes`; rounded to 256 bytes when large."""
    itemsize = plan.itemsize
    streams = max(Partition(plan, binding, binding.processes[0]).most_streams(), 1)
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
    """How a stream of `length` elements is cut: sizes ramp up from bucket/16 (doubling) to `bucket` and down at
    the end, so the first pack and the last scatter, which nothing overlaps, are short."""
    ramp = [bucket >> j for j in (4, 3, 2, 1) if 0 < bucket >> j < bucket]
    middle = length - 2 * sum(ramp)
    if middle >= 0:
        full, rest = divmod(middle, bucket)
        return ramp + [bucket] * full + ([rest] if rest else []) + ramp[::-1]
    sizes = np.diff(np.minimum(np.cumsum(ramp + [bucket] * (length // bucket + 1)), length), prepend=0)
    return sizes[sizes > 0].tolist()  # the ramp up, as far as the stream goes


def _split(p: dict[str, np.ndarray], cuts: np.ndarray) -> dict[str, np.ndarray]:
    """Split blocks at the cut positions (sorted; 'w' = a block's first element on the wire): a block straddling
    a cut becomes whole rows before it, a partial row up to it, the rest of that row, and the remaining rows."""
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


DIRECT_BYTES = 64 << 20  # runs contiguous in one side's memory at least this long travel unpacked
LANES_DIRECT_BYTES = 16 << 20  # the same with several lanes, where messages are cheap (lanes.py)
GLOO_DIRECT_BYTES = 64 << 10  # gloo: a message costs little next to a CPU copy (BENCHMARKS.md, Same host)


def build_schedule(plan: Plan, binding: Binding, process: int, bucket_numel: int, staged: bool,
                   direct_numel: int | None = None, undo: bool = False) -> RoundSchedule:
    """The part of the global schedule that `process` (a group rank) runs. `direct_numel`: the shortest
    contiguous run that travels as messages of its own (default DIRECT_BYTES). `undo` (not with `staged`): writes
    go in place, and every destination tensor written gets a shadow for its previous bytes."""
    if direct_numel is None:
        direct_numel = max(DIRECT_BYTES // plan.itemsize, 1)
    if bucket_numel < 1:
        raise ExecutionError(f"bucket_numel={bucket_numel} must be at least 1")
    if undo and staged:
        raise ExecutionError("undo and staged are two ways of keeping the previous weights; choose one")
    part = Partition(plan, binding, process)
    shadowed = part.in_flight if staged else np.zeros_like(part.in_flight)  # staged writes land here
    rounds = _rounds(part, bucket_numel, direct_numel, shadowed)
    local, deferred = part.local_copies(shadowed, ~part.in_flight if staged or undo else None)
    per_round = max((len({m.peer for m in r.sends}) + len({m.peer for m in r.recvs}) for r in rounds), default=0)
    return RoundSchedule(
        part=part, bucket_numel=bucket_numel, staged=staged, num_stages=plan.num_stages, rounds=rounds,
        local=tuple(local), deferred=deferred, commit=part.commit(shadowed) if staged else Copies.empty(),
        shadow=tuple(np.flatnonzero(part.in_flight if staged or undo else shadowed).tolist()), undo=undo,
        buffers_per_round=per_round)


def _rounds(part: Partition, bucket_numel: int, direct_numel: int, shadowed: np.ndarray) -> tuple[Round, ...]:
    """This process's messages, by global round, with their pack (scatter) programs. First the global cut of every
    stream into buckets and messages: the streams laid end to end on one wire, `w` each remote op's first element
    on it (in `order`), `bcuts` bucket and `cuts` message boundaries."""
    o, process = part.plan.ops, part.process
    stream_of, keys = part.streams  # (stage, sender, receiver) per stream
    remote = np.flatnonzero(stream_of >= 0)
    order = remote[np.argsort(stream_of[remote], kind="stable")]  # by stream, then plan order
    stream = stream_of[order]
    mine = (keys[stream, 1] == process) | (keys[stream, 2] == process)
    if not mine.any():
        return ()
    numel = o["rows"][order] * o["cols"][order]
    new = np.ones(len(order), dtype=bool)
    new[1:] = stream[1:] != stream[:-1]
    ends = np.cumsum(numel)
    w = ends - numel
    first = np.flatnonzero(new)
    stream_numel = np.diff(np.concatenate([w[first], [ends[-1]]]))
    sizes = [bucket_sizes(int(n), bucket_numel) for n in stream_numel.tolist()]
    buckets = np.asarray([len(x) for x in sizes], dtype=np.int64)
    bcuts = np.cumsum(np.concatenate([[0], *[np.asarray(x, np.int64) for x in sizes]]))
    first_bucket = np.concatenate([[0], np.cumsum(buckets)[:-1]])
    cuts = [bcuts]
    for side in ("src", "dst"):  # long runs contiguous in one side's memory travel as messages of their own
        runs = np.flatnonzero(run_starts(o, order, side, new))
        run_numel = np.add.reduceat(numel, runs)
        long = run_numel >= direct_numel
        cuts += [w[runs[long]], w[runs[long]] + run_numel[long]]
    cuts = np.unique(np.concatenate(cuts))
    per_stage = np.zeros(max(part.plan.num_stages, 1), np.int64)
    np.maximum.at(per_stage, keys[:, 0], buckets)
    round_base = np.concatenate([[0], np.cumsum(per_stage)[:-1]])
    sel = order[mine]  # this process's ops, cut at the message boundaries below
    pieces = _split({"op": sel, "stream": stream[mine], "w": w[mine], "so": o["src_offset"][sel],
                     "ss": o["src_stride"][sel], "do": o["dst_offset"][sel], "ds": o["dst_stride"][sel],
                     "rows": o["rows"][sel], "cols": o["cols"][sel]}, cuts)
    op = pieces["op"]
    cut = np.searchsorted(cuts, pieces["w"], side="right") - 1  # the piece's message, as its first cut
    wire_off = pieces["w"] - cuts[cut]
    msg_ids, msg_of = np.unique(cut, return_inverse=True)
    msg_of = msg_of.reshape(-1)
    m_stream = np.zeros(len(msg_ids), np.int64)
    m_stream[msg_of] = pieces["stream"]
    m_bucket = np.searchsorted(bcuts, cuts[msg_ids], side="right") - 1
    m_k = m_bucket - first_bucket[m_stream]  # bucket (round) index inside the stream
    m_offset = cuts[msg_ids] - bcuts[m_bucket]  # where the message sits in its round's wire buffer
    m_numel = cuts[msg_ids + 1] - cuts[msg_ids]
    is_send = part.sender[op] == process
    s, r = is_send, ~is_send
    d_t = o["dst_tensor"][op][r]
    pack = fold(part.read_kind(op[s], shadowed), o["src_tensor"][op][s], pieces["so"][s], pieces["ss"][s],
                WIRE, msg_of[s], wire_off[s], pieces["cols"][s], pieces["rows"][s], pieces["cols"][s])
    scatter = fold(WIRE, msg_of[r], wire_off[r], pieces["cols"][r], np.where(shadowed[d_t], SHADOW, DST), d_t,
                   pieces["do"][r], pieces["ds"][r], pieces["rows"][r], pieces["cols"][r])
    msg_send = np.zeros(len(msg_ids), dtype=bool)
    msg_send[msg_of[is_send]] = True
    by_msg = _per_message(pack, "dst_id", len(msg_ids)) | _per_message(scatter, "src_id", len(msg_ids))
    rounds: dict[int, dict] = {}
    for m in range(len(msg_ids)):
        stage, sender, receiver = (int(x) for x in keys[m_stream[m]])
        rnd = int(round_base[stage]) + int(m_k[m])
        peer = receiver if msg_send[m] else sender
        entry = rounds.setdefault(rnd, {"stage": stage, "sends": [], "recvs": []})
        entry["sends" if msg_send[m] else "recvs"].append(
            Message(peer, int(m_numel[m]), by_msg[m], int(m_offset[m]), int(msg_ids[m])))
    in_order = lambda ms: tuple(sorted(ms, key=lambda m: (m.peer, m.offset)))  # noqa: E731 - both sides agree
    return tuple(Round(r, e["stage"], in_order(e["sends"]), in_order(e["recvs"])) for r, e in sorted(rounds.items()))


def _per_message(program: Copies, col: str, count: int) -> dict[int, Copies]:
    """A program's copies per message (its wire id in `col`), each message's wire renumbered 0: its own buffer."""
    ids = program.cols[col]
    srt = np.argsort(ids, kind="stable")
    bounds = np.searchsorted(ids[srt], np.arange(count + 1))
    out = {}
    for m in np.unique(ids).tolist():
        part = program.select(srt[bounds[m]:bounds[m + 1]])
        out[m] = Copies({**part.cols, col: np.zeros(len(part), np.int64)})
    return out


def run_starts(o: dict[str, np.ndarray], ops: np.ndarray, side: str, new: np.ndarray | None = None) -> np.ndarray:
    """Where runs start, as a mask over `ops`: a run is a longest chain of ops contiguous in one side's memory
    ("src" or "dst"), each starting where the previous one ends (and in one stream: `new` marks first ops)."""
    rows, cols = o["rows"][ops], o["cols"][ops]
    contiguous = (rows == 1) | (cols == o[f"{side}_stride"][ops])
    off, tensor = o[f"{side}_offset"][ops], o[f"{side}_tensor"][ops]
    kind = o["src_side"][ops] if side == "src" else np.zeros(len(ops), np.int64)
    chain = np.zeros(len(ops), dtype=bool)
    chain[1:] = (contiguous[1:] & contiguous[:-1] & (kind[1:] == kind[:-1]) & (tensor[1:] == tensor[:-1])
                 & (off[1:] == off[:-1] + (rows * cols)[:-1]))
    return ~chain if new is None else ~chain | new
