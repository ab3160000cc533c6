"""Delta refits: move only the elements changed since the version the engine holds, written in place.

The executors' `delta=DeltaPolicy(keyframe_every=K)` option turns this protocol on:

- The sender (`Sender`) keeps a copy of the source tensors its ops read, as of the version it last sent, and
  encodes each op's changed elements (compared bit for bit) in the smallest of planner.delta's encodings (sparse,
  bitmap or dense); unchanged ops are left out. The copy is updated once the refit succeeded.
- A keyframe (the executor's dense refit) comes first, every K versions, and whenever the engine's version is not
  the sender's base; every process learns every other's versions first, so all pick the same.
- The receiver (`Receiver`) refuses, before writing anything, a delta against another version than it holds, a
  malformed payload and whatever planner.delta.prove_delta refuses; then it scatters the values in place in
  O(changed elements) (`index_put_` on CPU, kernels.delta_apply on GPUs), value shifts added as the dense refit
  adds them. Checksums cover the resulting weights, delta or keyframe alike.

A payload (one per sender and receiving process) is one uint8 buffer, every section 8-byte aligned: a header of
int64 words (MAGIC, FORMAT, base version, version, entries, itemsize, digest bytes, 0), the entries (op row,
encoding, count: int64 x 3 each), the sender's digest, then the sparse entries' int32 indices, the bitmaps, the
non-dense entries' values and the dense entries' blocks. Entries are sorted by destination tensor and op, so the
receiver scatters each tensor's elements as one slice.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import torch

from ..arguments import integer
from ..errors import ArgumentError, CoverageError, ExecutionError
from ..kernels import triton_available
from ..planner.delta import BITMAP, DENSE, ENCODINGS, SPARSE, DeltaOps, choose, prove_delta
from ..planner.plan import RELAY
from .checksum import blocks_digest
from .reference import apply_shifts, block, op_blocks, shift_views
from .base import RefitStats

MAGIC = 0x41544C4544534552  # b"RESDELTA" little-endian
FORMAT = 1
HEADER_WORDS = 8
WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # units compared and moved as bits


class DeltaError(ExecutionError):
    """A delta the receiver refuses (wrong base, malformed, out of range, larger than dense); nothing written."""


@dataclass(frozen=True)
class DeltaPolicy:
    """The executors' `delta` option: delta refits, with a dense keyframe every `keyframe_every` versions.

    Args:
        keyframe_every: a keyframe every this many refits, the keyframe counted (1: every refit dense); keyframes
            also come first and whenever the engine does not hold the sender's base.
        state: a `DeltaState` keeping this process's side between executors; None: kept in the executor.

    Raises:
        ArgumentError: keyframe_every not an integer >= 1, or state not a DeltaState.
    """

    keyframe_every: int = 16
    state: "DeltaState | None" = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        integer("keyframe_every", self.keyframe_every, 1, 1 << 30)
        if self.state is not None and not isinstance(self.state, DeltaState):
            raise ArgumentError("state", self.state, "must be a DeltaState (or None)")


def check_policy(policy: object) -> DeltaPolicy:
    """`policy`, refused unless a DeltaPolicy (ArgumentError)."""
    if not isinstance(policy, DeltaPolicy):
        raise ArgumentError("delta", policy, "must be a DeltaPolicy (or None: every refit dense)")
    return policy


class DeltaState:
    """One process's side of the delta protocol for one plan, kept between executors (for integrations that
    make executors anew each refit, as verl's backend): pass it as `DeltaPolicy(state=...)` to each, with the same
    destination tensors. After a failed refit `forget` it (or use a new one): the next refit is a keyframe.
    """

    def __init__(self) -> None:
        self._sender: Sender | None = None
        self._receiver: Receiver | None = None

    def sender(self, plan, ops: np.ndarray) -> "Sender":
        """The kept sender for `plan`'s `ops` (a new one where the plan or the ops differ from the kept one's)."""
        kept = self._sender
        if kept is None or kept.plan.digest != plan.digest or not np.array_equal(kept.ops, ops):
            self._sender = Sender(plan, ops)
        return self._sender

    def receiver(self, plan) -> "Receiver":
        """The kept receiver for `plan` (a new one, holding no version, where the plan differs)."""
        if self._receiver is None or self._receiver.plan.digest != plan.digest:
            self._receiver = Receiver(plan)
        return self._receiver

    def forget(self) -> None:
        """Nothing known of what the engine holds: the next refit is a keyframe."""
        self._sender = self._receiver = None


@dataclass(frozen=True)
class DeltaReport:
    """What one refit of the delta protocol moved (an executor's `last_delta`).

    Attributes:
        version: the version the refit made.
        base: the version the delta was computed against (None: a keyframe).
        ops: entries per encoding ("dense", "sparse", "bitmap", and "unchanged": ops left out).
        changed: elements written by non-dense entries plus the elements of dense entries.
        wire_bytes: payload bytes (headers included) this process sent or, in process, moved.
        dense_bytes: the bytes the dense refit of the same ops moves.
    """

    version: int
    base: int | None
    ops: dict[str, int] = field(default_factory=dict)
    changed: int = 0
    wire_bytes: int = 0
    dense_bytes: int = 0

    @property
    def entries(self) -> int:
        """Ops the refit wrote (every encoding but "unchanged")."""
        return sum(n for name, n in self.ops.items() if name != "unchanged")

    @property
    def keyframe(self) -> bool:
        """Whether this refit was a keyframe (dense)."""
        return self.base is None


def keyframe_report(plan, ops: np.ndarray, version: int) -> DeltaReport:
    """The `DeltaReport` of a keyframe over the plan op rows `ops`: every op dense, every byte on the wire."""
    o = plan.ops
    numel = int((o["rows"][ops] * o["cols"][ops]).sum())
    return DeltaReport(version, None, {"dense": len(ops)}, numel, numel * plan.itemsize, numel * plan.itemsize)


def _pad(n: int) -> int:
    return (int(n) + 7) // 8 * 8


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A flat tensor's units as integers of the same width (compared bit for bit: -0.0 != 0.0, NaN == NaN)."""
    return t.view(WORDS[t.element_size()])


def _sections(plan, op: np.ndarray, enc: np.ndarray, count: np.ndarray, digest_bytes: int) -> dict[str, int]:
    """Byte offsets of a payload's sections (module docstring) and its total length."""
    o, size = plan.ops, plan.itemsize
    box = o["rows"][op] * o["cols"][op]
    at = {"header": 0, "entries": 8 * HEADER_WORDS}
    at["digest"] = at["entries"] + 24 * len(op)
    at["index"] = at["digest"] + _pad(digest_bytes)
    at["bitmap"] = at["index"] + _pad(4 * count[enc == SPARSE].sum())
    at["values"] = at["bitmap"] + _pad(((box[enc == BITMAP] + 7) // 8).sum())
    at["dense"] = at["values"] + _pad(size * count[enc != DENSE].sum())
    at["total"] = at["dense"] + _pad(size * box[enc == DENSE].sum())
    return at


class Sender:
    """A sender's side for the plan ops `ops`: the copy of what the engine holds and the encoding of changes."""

    def __init__(self, plan, ops: np.ndarray) -> None:
        self.plan, self.ops = plan, np.asarray(ops, dtype=np.int64)
        self.base: int | None = None  # the version the copies hold (None: none yet, or after a failure)
        self.deltas = 0  # delta refits since the last keyframe
        self.copies: dict[int, torch.Tensor] = {}
        self.pending: tuple[int | None, dict[int, torch.Tensor]] = (None, {})  # a refit's changed positions per tensor

    def keyframe_due(self, policy: DeltaPolicy) -> bool:
        """Whether this sender's next refit must be a keyframe: no base, or K versions since the last one."""
        return self.base is None or self.deltas + 1 >= policy.keyframe_every

    def committed(self, version: int, src_flat: dict[int, torch.Tensor], keyframe: bool) -> None:
        """The refit to `version` succeeded everywhere: the copies become what was sent."""
        known, changed = self.pending
        with torch.no_grad():
            for t in sorted(set(self.plan.ops["src_tensor"][self.ops].tolist())):
                if t not in self.copies:
                    self.copies[t] = torch.empty_like(src_flat[t])
                where = changed.get(t) if not keyframe and known == version else None
                if where is None:
                    self.copies[t].copy_(src_flat[t])
                else:  # O(changed): only what the delta carried moved
                    _bits(self.copies[t]).index_put_((where,), _bits(src_flat[t])[where])
        self.base, self.deltas = int(version), 0 if keyframe else self.deltas + 1
        self.pending = (None, {})

    def forget(self) -> None:
        """After a failed refit nobody knows what the engine holds: the next refit is a keyframe."""
        self.base, self.pending = None, (None, {})

    def encode(self, ops: np.ndarray, version: int, src_flat: dict[int, torch.Tensor],
               digest: bytes = b"") -> tuple[torch.Tensor, DeltaOps]:
        """The payload of the delta from `self.base` to `version` over the plan ops `ops`, and its entries.

        Raises:
            ExecutionError: there is no base to compute a delta against.
        """
        if self.base is None:
            raise ExecutionError("no base version to compute a delta against: a keyframe must come first")
        o, size = self.plan.ops, self.plan.itemsize
        ops = np.asarray(ops, dtype=np.int64)
        ops = ops[np.lexsort((ops, o["dst_tensor"][ops]))]  # by destination tensor: one slice each at the receiver
        device = next(iter(src_flat.values())).device if src_flat else torch.device("cpu")
        with torch.no_grad():  # the changed positions of each source tensor once (O(N)), then each op's (O(changed))
            if self.pending[0] != version:
                self.pending = (version, {})
            changed = self.pending[1]  # kept for the other receivers' payloads and for `committed`
            for t in set(o["src_tensor"][ops].tolist()) - set(changed):
                changed[t] = _changed(_bits(src_flat[t]), _bits(self.copies[t]))
            boxes = [o[c][ops] for c in ("src_tensor", "src_offset", "rows", "cols", "src_stride")]
            found = _in_boxes(changed, *boxes)
            cols = [x.tolist() for x in boxes]
            count = np.asarray([len(i) for i in found], dtype=np.int64)
            box = o["rows"][ops] * o["cols"][ops]
            enc = choose(box, count, size)
            keep = np.flatnonzero(count > 0)
            op, enc, count = ops[keep], enc[keep], np.where(enc[keep] == DENSE, box[keep], count[keep])
            pos = _sections(self.plan, op, enc, count, len(digest))
            payload = torch.zeros(pos["total"], dtype=torch.uint8, device=device)

            def put(section: str, data: torch.Tensor) -> None:  # the next bytes of `section`, in data's shape
                n = data.numel() * data.element_size()
                payload.narrow(0, pos[section], n).view(data.dtype).view(data.shape).copy_(data)
                pos[section] += n

            put("header", torch.tensor([MAGIC, FORMAT, self.base, version, len(op), size, len(digest), 0]))
            put("entries", torch.from_numpy(np.stack([op, enc, count], axis=1).astype(np.int64)))
            put("digest", torch.tensor(list(digest), dtype=torch.uint8))
            indices = []
            for k, e in zip(keep.tolist(), enc.tolist()):
                t, off, r, c, s = (x[k] for x in cols)
                flat, idx = _bits(src_flat[t]), found[k]
                if e == DENSE:
                    put("dense", block(flat, off, r, c, s))
                    continue
                put(*(("index", idx.to(torch.int32)) if e == SPARSE else ("bitmap", pack_bits(idx, r * c))))
                indices.append(idx)
                put("values", flat[off + (idx // c) * s + idx % c])
        index = torch.cat(indices) if indices else torch.zeros(0, dtype=torch.int64, device=device)
        return payload, DeltaOps(op, enc, count, index)

    def report(self, ops: np.ndarray, deltas: "list[DeltaOps]", version: int, wire_bytes: int) -> DeltaReport:
        """The `DeltaReport` of the deltas (one a receiving process) over the plan op rows `ops`."""
        o = self.plan.ops
        encoding = np.concatenate([d.encoding for d in deltas]) if deltas else np.zeros(0, np.int64)
        counts = {name: int((encoding == code).sum()) for code, name in enumerate(ENCODINGS)}
        counts["unchanged"] = len(ops) - len(encoding)
        return DeltaReport(version, self.base, counts, sum(int(d.count.sum()) for d in deltas), int(wire_bytes),
                           int((o["rows"][ops] * o["cols"][ops]).sum()) * self.plan.itemsize)


def _changed(now: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """The sorted flat positions where two flat integer tensors differ (numpy's on CPU: 3x torch's nonzero there)."""
    if now.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(now.numpy() != before.numpy()))
    return torch.nonzero(now != before).view(-1)


def _in_boxes(changed: dict[int, torch.Tensor], tensors: np.ndarray, offsets: np.ndarray, rows: np.ndarray,
              cols: np.ndarray, strides: np.ndarray) -> list[torch.Tensor]:
    """Per block (source tensor, offset, rows x cols, row stride), the box-local indices (r * cols + c, ascending)
    of the sorted flat positions `changed[tensor]` inside it: one search per tensor (one host round trip, not one
    a block), then a filter for strided blocks."""
    out: list[torch.Tensor] = [torch.zeros(0, dtype=torch.int64)] * len(tensors)
    for t in np.unique(tensors).tolist():
        k = np.flatnonzero(tensors == t)
        positions = changed[t]
        bounds = np.stack([offsets[k], offsets[k] + (rows[k] - 1) * strides[k] + cols[k]], axis=1)
        ranges = torch.searchsorted(positions, torch.from_numpy(bounds.reshape(-1)).to(positions.device))
        for j, (a, b) in zip(k.tolist(), ranges.view(-1, 2).tolist()):
            p = positions[a:b] - int(offsets[j])
            if rows[j] > 1 and strides[j] != cols[j]:
                row, col = p // int(strides[j]), p % int(strides[j])
                p = (row * int(cols[j]) + col)[col < int(cols[j])]
            out[j] = p
    return out


def pack_bits(index: torch.Tensor, n: int) -> torch.Tensor:
    """The bitmap of `n` elements with the ascending indices `index` set (bit j of byte k: element 8k + j; padding
    bits zero), on the indices' device."""
    if index.device.type == "cpu":
        bits = np.zeros(n, dtype=bool)
        bits[index.numpy()] = True
        return torch.from_numpy(np.packbits(bits, bitorder="little"))
    packed = torch.zeros((n + 7) // 8, dtype=torch.uint8, device=index.device)
    if len(index):  # distinct bits of one byte: their sum is their OR (an atomic add on GPUs)
        packed.index_put_((index // 8,), torch.bitwise_left_shift(torch.ones_like(index), index % 8).to(torch.uint8),
                          accumulate=True)
    return packed


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """The indices of the set bits of a bitmap (`pack_bits`' layout, padding included), ascending, int64."""
    if packed.device.type == "cpu":  # the set bits of the bytes that have any
        b = packed.numpy()
        nonzero = np.flatnonzero(b)
        r, c = np.nonzero(np.unpackbits(b[nonzero][:, None], axis=1, bitorder="little"))
        return torch.from_numpy(nonzero[r] * 8 + c)
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).view(-1).nonzero().view(-1)


@dataclass(frozen=True, eq=False)
class Decoded:
    """A payload read and proven (`Receiver.read`): its entries, their indices and values as views of it."""

    delta: DeltaOps  # its indices on the payload's device
    values: torch.Tensor  # the non-dense entries' values, in the plan's unit width (bits)
    dense: torch.Tensor  # the dense entries' blocks, concatenated
    digest: bytes


class Receiver:
    """A receiving process's side: the version its destination tensors hold, the checks, the in-place scatter.

    Args:
        plan: the plan.
        kernel: scatter with the Triton kernel (kernels.delta_apply); None: on GPUs where Triton is there (True
            on CPU runs Triton's interpreter).
    """

    def __init__(self, plan, kernel: bool | None = None) -> None:
        self.plan, self.kernel = plan, kernel
        self.held: int | None = None  # the version the destination tensors hold (None: unknown)

    def read(self, payload: torch.Tensor, allowed: np.ndarray, sender: str = "the sender") -> Decoded:
        """Check a payload against the plan, the ops `allowed` from this sender and the version held; its entries
        and views.

        Raises:
            DeltaError: naming what is wrong (nothing is written by reading).
        """
        size, n = self.plan.itemsize, payload.numel()
        if payload.dtype != torch.uint8 or payload.dim() != 1 or n < 8 * HEADER_WORDS or n % 8:
            raise DeltaError(f"delta from {sender}: a payload of {n} bytes is not a delta (malformed); nothing "
                             f"was written")
        head = payload[:8 * HEADER_WORDS].cpu().numpy().view(np.int64)
        magic, fmt, base, version, entries, itemsize, digest_bytes, _ = (int(v) for v in head)
        if magic != np.int64(np.uint64(MAGIC)) or fmt != FORMAT or itemsize != size or not 0 <= digest_bytes <= 64:
            raise DeltaError(f"delta from {sender}: header (format {fmt}, itemsize {itemsize}) is not a delta of "
                             f"this plan (format {FORMAT}, itemsize {size}); nothing was written")
        if base != self.held:
            held = "no version (a keyframe must come first)" if self.held is None else f"version {self.held}"
            raise DeltaError(f"delta from {sender} was computed against version {base}, but the engine holds "
                             f"{held}; nothing was written")
        if not 0 <= entries <= (n - 8 * HEADER_WORDS) // 24:
            raise DeltaError(f"delta from {sender}: {entries} entries do not fit its {n} bytes; nothing was written")
        table = payload[8 * HEADER_WORDS:8 * HEADER_WORDS + 24 * entries].cpu().numpy().view(np.int64).reshape(-1, 3)
        op, enc, count = table[:, 0], table[:, 1], table[:, 2]
        self._prove(DeltaOps(op, enc, count, np.zeros(0, np.int64)), allowed, sender, indices=False)
        at = _sections(self.plan, op, enc, count, digest_bytes)
        if at["total"] != n:
            raise DeltaError(f"delta from {sender}: {n} bytes, its entries need {at['total']}; nothing was written")
        o = self.plan.ops
        box = o["rows"][op] * o["cols"][op]
        sparse = payload.narrow(0, at["index"], 4 * int(count[enc == SPARSE].sum())).view(torch.int32)
        parts, s_at, b_at = [], 0, at["bitmap"]
        for e, c, b in zip(enc.tolist(), count.tolist(), box.tolist()):
            if e == SPARSE:
                parts.append(sparse.narrow(0, s_at, c).long())
                s_at += c
            elif e == BITMAP:
                idx = unpack_bits(payload.narrow(0, b_at, (b + 7) // 8))
                b_at += (b + 7) // 8
                if len(idx) != c or (len(idx) and int(idx[-1]) >= b):
                    raise DeltaError(f"delta from {sender}: a bitmap of op with {c} changed elements sets "
                                     f"{len(idx)} bits (some past its box of {b}); nothing was written")
                parts.append(idx)
        index = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=payload.device)
        self._prove(DeltaOps(op, enc, count, index), allowed, sender)
        unit = WORDS[size]
        values = payload.narrow(0, at["values"], size * int(count[enc != DENSE].sum())).view(unit)
        dense = payload.narrow(0, at["dense"], size * int(box[enc == DENSE].sum())).view(unit)
        digest = bytes(payload.narrow(0, at["digest"], digest_bytes).cpu().tolist())
        return Decoded(DeltaOps(op, enc, count, index), values, dense, digest)

    def _prove(self, delta: DeltaOps, allowed: np.ndarray, sender: str, indices: bool = True) -> None:
        try:
            prove_delta(self.plan, delta, allowed, indices=indices)
        except CoverageError as e:
            raise DeltaError(f"delta from {sender} refused: {'; '.join(e.problems[:5])}; nothing was written") from e

    def apply(self, decoded: Decoded, dst_flat: dict[int, torch.Tensor]) -> None:
        """Write a read payload into the destination tensors (flat views by table id), in place, O(changed)."""
        plan, o = self.plan, self.plan.ops
        d = decoded.delta
        shifts = plan.value_shifts
        with torch.no_grad():
            dense = d.op[d.encoding == DENSE]  # whole blocks, as the dense refit copies them
            bits = {int(t): _bits(dst_flat[int(t)]) for t in np.unique(o["dst_tensor"][dense])}
            views = op_blocks(plan, dense, "dst", bits)
            for view, data in zip(views, decoded.dense.split([v.numel() for v in views])):
                view.copy_(data.view(view.shape))
            apply_shifts(shift_views(plan, dst_flat, dense))
            sel = np.flatnonzero(d.encoding != DENSE)
            if not len(sel):
                return
            op, count = d.op[sel], d.count[sel]
            values = decoded.values
            shifted = [(j, shifts[int(o["canon"][op[j]])]) for j in range(len(op)) if int(o["canon"][op[j]]) in shifts]
            if shifted:  # the dense refit adds them after its copy, in the tensor's dtype: the same rounding here
                values = values.clone()
                typed = values.view(dst_flat[int(o["dst_tensor"][op[0]])].dtype)
                starts = np.cumsum(count) - count
                for j, value in shifted:
                    typed.narrow(0, int(starts[j]), int(count[j])).add_(value)
            use_kernel = self.kernel
            if use_kernel is None:
                use_kernel = values.device.type == "cuda" and triton_available()
            if use_kernel:
                from ..kernels.delta_apply import scatter

                scatter([_bits(dst_flat[int(t)]) for t in o["dst_tensor"][op]], o["dst_offset"][op], count,
                        o["cols"][op], o["dst_stride"][op], d.index, values)
                return
            idx, where = d.index, torch.empty_like(d.index)
            starts = (np.cumsum(count) - count).tolist()
            for lo, n, off, r, c, s in zip(starts, count.tolist(), *(o[x][op].tolist() for x in
                                                                     ("dst_offset", "rows", "cols", "dst_stride"))):
                seg = idx.narrow(0, lo, n)  # flat positions, entry by entry (no per-element op columns)
                where.narrow(0, lo, n).copy_(seg + off if r == 1 else off + (seg // c) * s + seg % c)
            tensors = o["dst_tensor"][op]
            ends = np.cumsum(count)
            change = np.flatnonzero(tensors[1:] != tensors[:-1]) + 1
            for a, b in zip(np.concatenate([[0], change]).tolist(), np.concatenate([change, [len(op)]]).tolist()):
                lo, hi = int(ends[a] - count[a]), int(ends[b - 1])
                _bits(dst_flat[int(tensors[a])]).index_put_((where[lo:hi],), values[lo:hi])


class VotedDelta:
    """One process's delta refits, voted on before anyone writes; the protocol's one loop. Per refit `v`:
    `keyframe` (every process tells its held and base versions and whether it is due; all take the same path); for
    a delta, `transfer` (each sender encodes a payload per receiving process, `_move` hands them over, and each
    receiver reads and proves what arrived, nothing written); after the vote, `commit` scatters the payloads in
    place. A failure anywhere fails the refit everywhere before any destination is written.

    Here the transport is a store (executors.voted: shared memory, NIXL): subclasses give `deliver` and `arrived`;
    the collective executor's (executors.collective.delta) tells versions and moves payloads over its group.

    Args:
        executor: the executor (its process, plan, binding, exchange, poll_max_s, src_flat, dst_flat).
        policy: the `DeltaPolicy`.
        part: the executor's `executors.partition.Partition`.
        checksum: the checksum algorithm, or None.

    Raises:
        ArgumentError: `policy` is not a DeltaPolicy.
        ExecutionError: the plan relays between replicas (fan-out), or (`cpu`) the executor's tensors are not on
            the CPU.
    """

    peer = "process {}"  # a peer in messages

    def __init__(self, executor, policy: DeltaPolicy, part, checksum: str | None, cpu: bool = False) -> None:
        me, o = part.process, executor.plan.ops
        if cpu and executor.device.type != "cpu":
            raise ExecutionError(f"delta refits over {executor.label} run on CPU tensors (GPUs: the collective "
                                 f"executor's delta option)")
        if np.any(o["src_side"] == RELAY):
            raise ExecutionError("delta refits need a plan without fan-out (relays between replicas); compile it "
                                 "without fanout")
        self.ex, self.me, self.policy, self.checksum = executor, me, check_policy(policy), checksum
        local = {me: part.local} if len(part.local) else {}  # with no relays, an op's sender plays its source rank
        self.sends = dict(sorted({**local, **part.sends_to}.items()))  # peer -> ops, this process's own included
        self.recvs = dict(sorted({**local, **part.receives_from}.items()))
        self.feeders = sorted(part.receives_from)
        mine_out = np.flatnonzero(part.sender == me)
        state = policy.state or DeltaState()  # the sides kept between executors, else this one's
        self.sender = state.sender(executor.plan, mine_out) if len(mine_out) else None
        self.receiver = state.receiver(executor.plan) if len(part.landing) else None
        self._start(0)
        self.last: DeltaReport | None = None

    # --- the transport's -----------------------------------------------------------------------------
    def deliver(self, q: int, payload: torch.Tensor, v: int, deadline: float) -> dict:
        """Put `payload` where process `q` reads it (q is ready for refit `v`); JSON fields saying where."""
        raise NotImplementedError

    def arrived(self, f: int, where: dict, n: int, v: int, deadline: float) -> torch.Tensor:
        """The `n`-byte payload feeder `f` delivered for refit `v` (`where`: what its `deliver` returned), by
        `deadline`."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the transport's payload memory."""

    def _flats(self) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """(source, destination) flat views by tensor id: the executor's."""
        return self.ex.src_flat, self.ex.dst_flat

    # --- the protocol --------------------------------------------------------------------------------
    def keyframe(self, v: int, deadline: float) -> bool:
        """Whether refit `v` is a keyframe, the same on every process."""
        ex, store = self.ex.exchange, self.ex.exchange.store
        mine = {"receiver": self.receiver is not None, "held": None if self.receiver is None else self.receiver.held,
                "sender": self.sender is not None, "base": None if self.sender is None else self.sender.base,
                "due": self.sender is not None and self.sender.keyframe_due(self.policy)}
        store.set(f"v{v}/delta/{self.me}", json.dumps(mine))
        ex.signal(f"v{v}/delta")
        ex.wait_count(f"v{v}/delta", self.ex.num_processes, v, deadline, self.ex.poll_max_s,
                      f"every process's versions for refit {v}")
        versions, due = set(), False
        for p in self.ex.binding.processes:
            theirs = json.loads(store.get(f"v{v}/delta/{p}"))
            due = due or bool(theirs["due"])
            versions |= {theirs[k] for k, present in (("held", "receiver"), ("base", "sender")) if theirs[present]}
        return self._start(v, due, versions)

    def _start(self, v: int, due: bool = True, versions: "set[int | None]" = frozenset()) -> bool:
        """Refit `v` begins, told whether any sender is `due` a keyframe and the `versions` every receiver holds and
        every sender's copy is of (None: unknown); returns whether it is a keyframe: due, or no one common base."""
        self.is_keyframe = keyframe = due or len(versions) != 1 or None in versions
        self.decoded: list[Decoded] = []  # this refit's proven payloads, applied at commit
        self.sent: dict[int, int] = {}  # this refit's payload bytes per receiving process
        self.received: dict[int, int] = {}  # ... and per feeding peer
        self.applied = 0  # entries the last delta wrote here
        if keyframe:
            ops = self.sender.ops if self.sender is not None else np.zeros(0, np.int64)
            self.last = keyframe_report(self.ex.plan, ops, v)
        return keyframe

    def transfer(self, v: int, deadline: float) -> None:
        """A delta refit's payloads delivered, and every one this process receives proven (nothing written)."""
        self._prove(self._move(self._encode(v), v, deadline))

    def _encode(self, v: int) -> dict[int, torch.Tensor]:
        """This process's payload per receiving process (its own included) of delta refit `v`; sets `last`."""
        plan, src_flat = self.ex.plan, self._flats()[0]
        payloads, encoded = {}, []
        for q, ops in self.sends.items():
            digest = b""
            if self.checksum:  # of the blocks the ops (plan order) leave at q: the source blocks, value shifts added
                shifts = [plan.value_shifts.get(int(c)) for c in plan.ops["canon"][ops]]
                digest = blocks_digest(self.checksum, [b + s if s else b for b, s in
                                                       zip(op_blocks(plan, ops, "src", src_flat), shifts)])
            payloads[q], d = self.sender.encode(ops, v, src_flat, digest=digest)
            encoded.append(d)
        self.sent = {q: p.numel() for q, p in payloads.items()}
        if self.sender is None:  # a receiver only: it sent nothing
            self.last = DeltaReport(v, self.receiver.held if self.receiver is not None else None)
        else:  # before the copy moves on: its base is the delta's
            self.last = self.sender.report(np.concatenate(list(self.sends.values())), encoded, v,
                                           sum(self.sent.values()))
        return payloads

    def _move(self, payloads: dict[int, torch.Tensor], v: int, deadline: float) -> dict[int, torch.Tensor]:
        """Every payload to its process (`deliver`, once it is ready); the payloads that arrived here, by sender."""
        ex, me, poll_max_s = self.ex.exchange, self.me, self.ex.poll_max_s
        if self.feeders:
            ex.signal(f"v{v}/ready/{me}")
        for q, payload in payloads.items():
            if q == me:
                continue
            ex.wait_count(f"v{v}/ready/{q}", 1, v, deadline, poll_max_s, f"process {q} to be ready for refit {v}")
            where = self.deliver(q, payload, v, deadline)
            ex.store.set(f"v{v}/payload/{me}/{q}", json.dumps({**where, "bytes": payload.numel()}))
            ex.signal(f"v{v}/done/{q}")
        arrived = {me: payloads[me]} if me in payloads else {}
        if self.feeders:
            ex.wait_count(f"v{v}/done/{me}", len(self.feeders), v, deadline, poll_max_s,
                          f"processes {self.feeders} to deliver their deltas of refit {v}")
        for f in self.feeders:
            try:
                where = json.loads(ex.store.get(f"v{v}/payload/{f}/{me}"))
                n = int(where["bytes"])
            except (KeyError, TypeError, ValueError) as e:
                raise DeltaError(f"process {f} published a malformed delta location ({e}); nothing was "
                                 f"written") from e
            if not 0 <= n <= 1 << 40:
                raise DeltaError(f"process {f} announced a delta of {n} bytes; nothing was written")
            arrived[f] = self.arrived(f, where, n, v, deadline)
            self.received[f] = n
        return arrived

    def _prove(self, arrived: dict[int, torch.Tensor]) -> None:
        """Read and prove every payload that arrived, writing nothing; kept for `commit`. With a checksum, the
        weights it would leave (on a copy) must hash to the sender's digest.

        Raises:
            DeltaError: a payload refused (`Receiver.read`), or the digests differ (a payload changed on the way).
        """
        plan, dst_flat = self.ex.plan, self._flats()[1]
        for f, ops in self.recvs.items():
            name = "this process" if f == self.me else self.peer.format(f)
            d = self.receiver.read(arrived[f], ops, name)
            if self.checksum:
                shadow = {int(t): dst_flat[int(t)].clone() for t in np.unique(plan.ops["dst_tensor"][ops])}
                self.receiver.apply(d, shadow)
                digest = blocks_digest(self.checksum, op_blocks(plan, ops, "dst", shadow))
                if digest != d.digest:
                    raise DeltaError(f"checksum mismatch: the weights a delta from {name} would leave have checksum "
                                     f"{digest.hex()[:16]}, the sender's are {d.digest.hex()[:16]}; nothing was "
                                     f"written")
            self.decoded.append(d)

    def commit(self) -> bool:
        """After the vote: scatter a delta's payloads (True), or leave a keyframe to the dense commit (False)."""
        v, (src_flat, dst_flat) = self.last.version, self._flats()
        if not self.is_keyframe:
            for d in self.decoded:
                self.receiver.apply(d, dst_flat)
            self.applied, self.decoded = sum(len(d.delta) for d in self.decoded), []
        if self.sender is not None:
            self.sender.committed(v, src_flat, self.is_keyframe)
        if self.receiver is not None:
            self.receiver.held = v  # a keyframe's dense commit follows before the refit returns
        return not self.is_keyframe

    def keys(self, v: int) -> tuple[str, ...]:
        """Refit `v`'s store keys of this process (dropped once every process is past it)."""
        me = self.me
        return (f"v{v}/delta", f"v{v}/delta/{me}", f"v{v}/ready/{me}", f"v{v}/done/{me}",
                *(f"v{v}/payload/{f}/{me}" for f in self.feeders))

    def stats(self, v: int, seconds: float, phases: dict[str, float], staged: bool = False,
              **extra: int) -> RefitStats:
        """This process's RefitStats of delta refit `v`: payload bytes, not the dense bytes (`extra`: more
        fields)."""
        me = self.me
        return RefitStats(executor=self.ex.name, process=me, version=v, seconds=seconds, phases=phases,
                          staged=staged, ops=self.applied, copies=self.applied,
                          bytes_sent={q: n for q, n in self.sent.items() if q != me},
                          bytes_received=dict(self.received), local_bytes=self.sent.get(me, 0),
                          transfers=sum(q != me for q in self.sent) + len(self.received),
                          checksum=self.checksum or "", **extra)


def payload_bound(plan, ops: np.ndarray) -> int:
    """The most bytes a payload over the plan ops `ops` can take (every op dense, plus header, entries, digest and
    padding): the size of a fixed payload buffer."""
    o = plan.ops
    dense = int((o["rows"][ops] * o["cols"][ops]).sum()) * plan.itemsize
    return _pad(8 * HEADER_WORDS + 24 * len(ops) + 64 + dense + 5 * 8)


__all__ = ["Decoded", "DeltaError", "DeltaPolicy", "DeltaReport", "DeltaState", "Receiver", "Sender", "VotedDelta",
           "keyframe_report", "pack_bits", "payload_bound", "unpack_bits"]
