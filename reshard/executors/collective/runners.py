"""How one process runs its part of a schedule: buffers viewing its tensors, and a runner per device kind (each
reads the executor that runs it, `ex`: plan, schedule, group, depth, timeout)."""
from __future__ import annotations

import abc
import time
from datetime import timedelta

import numpy as np
import torch

from ...errors import ExecutionError
from ...polling import Background, wait_events
from ..checksum import Streams
from ..copies import DST, KIND_NAMES, SHADOW, SRC, WIRE, Copies, CopyViews, Memory, regions, view_copies
from ..reference import apply_shifts
from ..partition import Prepared

HOST_LEAD = 8  # rounds the host may enqueue ahead of the GPU (CudaRunner._keep_up)


class Buffers:
    """What an executor keeps between refits: the wire buffer (grown, never shrunk), the CUDA streams, and the
    schedule viewing the tensors of the last call, with their identity once they passed the checks (`given`)."""

    def __init__(self) -> None:
        self.wire: torch.Tensor | None = None
        self.streams: dict[str, torch.cuda.Stream] | None = None
        self.views: RoundViews | None = None
        self.given: tuple = ()  # (identity key, the tensors, kept so that their ids stay unique); () when unchecked

    def views_for(self, ex, device: torch.device, prepared: Prepared) -> "RoundViews":
        """The schedule as views of these tensors; the last views again for the same addresses and device."""
        s = ex.schedule
        key = (str(device), *(prepared.src_flat[i].data_ptr() for i in s.part.src_ids),
               *(prepared.dst_flat[i].data_ptr() for i in s.part.dst_ids))
        if self.views is None or self.views.key != key:
            self.views = None  # free the old views and staging before allocating new ones
            self.views = RoundViews(ex, self, device, prepared, key)
        return self.views


class RoundViews:
    """A schedule as views of one call's tensors (wire, staging, every copy program prebuilt: executors.copies),
    reused while the caller passes the same tensors."""

    def __init__(self, ex, kept: Buffers, device: torch.device, prepared: Prepared, key: tuple) -> None:
        s, plan = ex.schedule, ex.plan
        self.key, self.device = key, device
        itemsize = plan.itemsize
        # staging: one buffer for every shadow, each shadow aligned
        self.shadow, shadows = prepared.arena({i: prepared.dst_flat[i].numel() for i in s.shadow}, device)
        self.staging_bytes = self.shadow.numel() * itemsize if s.shadow else 0
        flats = {SRC: prepared.src_flat, DST: prepared.dst_flat, SHADOW: shadows}
        # the wire buffers (depth x buffers per round x bucket), kept between calls and grown as needed
        per_round, depth = max(s.buffers_per_round, 1), ex.depth
        need = depth * per_round * s.bucket_numel if s.rounds else 0
        if kept.wire is None or kept.wire.numel() < need or kept.wire.device != device:
            kept.wire = torch.empty(need, dtype=prepared.dtype, device=device)
        self.wire = kept.wire[:need].view(depth, per_round, s.bucket_numel) if need else None
        self.wire_bytes = need * itemsize
        wires: list[torch.Tensor] = []  # one view per packed message, into its round's buffer for its peer

        def flat(kind: int, i: int) -> torch.Tensor:
            if kind == WIRE:
                return wires[i]
            try:
                return flats[kind][i]
            except KeyError:
                raise ExecutionError(f"the schedule names {KIND_NAMES[kind]} tensor {i}, which this process "
                                     f"does not hold") from None

        memory = Memory(flat, itemsize)
        self._bind_rounds(ex, flat, memory, wires)
        # local copies of a stage, cut into one piece per round of that stage so they spread over the transfer
        rounds_in_stage = np.bincount(np.asarray([r.stage for r in s.rounds], np.int64), minlength=s.num_stages)
        local = [_pieces(c, max(int(k), 1)) for c, k in zip(s.local, rounds_in_stage)]
        self.local = [[view_copies(piece, memory, itemsize) for piece in pieces] for pieces in local]
        # undo: (backup, restore) of the regions a round's receives (a local piece) write, backed up first
        undo = lambda c: tuple(view_copies(regions(c, *way), memory, itemsize)  # noqa: E731
                               for way in ((DST, SHADOW), (SHADOW, DST)))
        self.backups = [undo(Copies.concat([m.copies for m in r.recvs])) if s.undo else None for r in s.rounds]
        self.local_backups = [[undo(c) if s.undo else None for c in pieces] for pieces in local]
        self.commit = view_copies(s.commit, memory, itemsize)
        self.deferred = view_copies(s.deferred, memory, itemsize)
        self.shifts = prepared.shifts()  # value shifts of this process's destination blocks
        self.ops: dict[tuple, list] = {}  # (round position, lane) -> its P2POps, built at first use

    def _bind_rounds(self, ex, flat, memory: Memory, wires: list) -> None:
        """Per round position: the buffers each message is sent from (received into) and the pack (scatter)
        programs of the messages that travel through a wire buffer."""
        s, depth, itemsize = ex.schedule, ex.depth, ex.plan.itemsize
        self.packs: list[list[CopyViews]] = []
        self.scatters: list[list[CopyViews]] = []
        self.send_bufs: list[list[torch.Tensor]] = []
        self.recv_bufs: list[list[torch.Tensor]] = []
        self.direct_bytes = 0
        for pos, r in enumerate(s.rounds):
            slot = pos % depth
            region = {("send", p): j for j, p in enumerate(sorted({m.peer for m in r.sends}))}
            region.update({("recv", p): len(region) + j for j, p in enumerate(sorted({m.peer for m in r.recvs}))})
            for way, msgs, progs, bufs in (("send", r.sends, self.packs, self.send_bufs),
                                           ("recv", r.recvs, self.scatters, self.recv_bufs)):
                progs.append([])
                bufs.append([])
                for m in msgs:
                    direct = m.contiguous()
                    if direct is not None:  # sent from / received into the tensor itself
                        kind, i, off = direct
                        bufs[-1].append(flat(kind, i).narrow(0, off, m.numel))
                        self.direct_bytes += m.numel * itemsize
                        continue
                    wires.append(self.wire[slot, region[(way, m.peer)], m.offset:m.offset + m.numel])
                    bufs[-1].append(wires[-1])
                    progs[-1].append(view_copies(_wire_id(m.copies, len(wires) - 1), memory, itemsize))


def _wire_id(c: Copies, wire: int) -> Copies:
    """`c` with its wire buffer renumbered `wire`."""
    return Copies({**c.cols, **{f"{side}_id": np.where(c.cols[f"{side}_kind"] == WIRE, wire, c.cols[f"{side}_id"])
                                for side in ("src", "dst")}})


def _pieces(c: Copies, k: int) -> list[Copies]:
    """Cut a program into k pieces of about equal bytes (in program order)."""
    if k == 1 or len(c) <= 1:
        return [c]
    size = c.cols["n"] * c.cols["rows"] * c.cols["cols"]
    start = np.cumsum(size) - size
    piece = np.minimum(start * k // max(int(size.sum()), 1), k - 1)
    return [c.select(piece == p) for p in range(k)]


def abort(groups: list, timeout: float) -> list:
    """Abort these groups' communicators all at once, each on a thread of its own, so that NCCL kernels waiting
    for a dead peer return; give back the groups whose abort did not finish within `timeout` seconds.

    All at once because an NCCL abort frees its buffers after setting its flag, and that free waits for the whole
    GPU: aborted one after another, the first waited forever for a lane not yet aborted (BENCHMARKS.md, NCCL)."""
    calls = [Background(lambda g: g.abort(), group, name=f"reshard-abort-{i}") for i, group in enumerate(groups)]
    deadline = time.monotonic() + timeout  # best effort: an abort's own error is left with its call
    return [group for group, call in zip(groups, calls) if not call.join(deadline)]


class RoundRunner(abc.ABC):
    """Runs one process's rounds over bound buffers. Round positions index `ex.schedule.rounds`."""

    def __init__(self, ex, kept: Buffers) -> None:
        self.ex, self.b = ex, kept.views
        self.rounds = ex.schedule.rounds
        self.copies = 0
        self.undo_log: list[tuple] = []  # (completion event or None, restore program), in launch order
        self.sums = Streams(ex.checksum) if ex.checksum else None  # this refit's checksums (executors.checksum)

    def restore(self) -> str:
        """Undo: after a failure, put back the previous bytes of every region that may have been written.
        Returns what happened, for the error message."""
        done = self._restore_log()
        return (f"destination tensors were restored to their previous weights ({done} backed-up regions put "
                f"back; undo)")

    def _restore_log(self) -> int:
        self._run([program for _, program in self.undo_log])
        return len(self.undo_log)

    def _run(self, programs) -> None:
        for p in programs:
            self.copies += len(p)
            p.run()

    def _backup(self, undo: "tuple[CopyViews, CopyViews] | None", stream=None) -> None:
        """Undo: copy the regions about to be written into the shadows and log how to put them back."""
        if undo is not None:
            self._run([undo[0]])
            self.undo_log.append((None if stream is None else stream.record_event(), undo[1]))

    def _sum(self, pos: int, way: str) -> None:
        """With checksums: hash round `pos`'s buffers sent ("to") or received ("from"), per peer, in round order."""
        if self.sums is not None:
            r = self.rounds[pos]
            bufs, msgs = (self.b.send_bufs[pos], r.sends) if way == "to" else (self.b.recv_bufs[pos], r.recvs)
            for buf, m in zip(bufs, msgs):
                self.sums.update((way, m.peer), buf)

    def _ops(self, pos: int):
        r, comm = self.rounds[pos], self.ex.comm
        lane = r.index % len(comm.lanes)  # both ends derive the lane from the global round
        key = (pos, lane, id(comm.lanes[lane]))
        ops = self.b.ops.get(key)
        if ops is None:  # built once per bound tensors and lane: a few microseconds per message saved per refit
            ops = self.b.ops[key] = comm.prepare(
                lane, [(b, m.peer, m.tag) for b, m in zip(self.b.send_bufs[pos], r.sends)],
                [(b, m.peer, m.tag) for b, m in zip(self.b.recv_bufs[pos], r.recvs)])
        return ops

    def describe(self, pos: int) -> str:
        """Round `pos` in words (its stage and the bytes it sends and receives, per peer), for error messages."""
        r, size = self.rounds[pos], self.ex.plan.itemsize
        parts = [f"send {m.numel * size} B to group rank {m.peer}" for m in r.sends]
        parts += [f"receive {m.numel * size} B from group rank {m.peer}" for m in r.recvs]
        return f"round {r.index} (stage {r.stage}: {', '.join(parts)})"

    @abc.abstractmethod
    def pack(self, pos: int) -> None:
        """Copy round `pos`'s sends into their wire buffers."""

    @abc.abstractmethod
    def post(self, pos: int):
        """Post round `pos`'s sends and receives as one batch; return what `complete` needs."""

    @abc.abstractmethod
    def complete(self, pending) -> None:
        """Wait for a posted round and scatter what it received."""

    def local(self, stage: int, piece: int, stream=None) -> None:
        """Run one piece of a stage's local copies (undo: backed up first)."""
        if piece < len(self.b.local[stage]):
            self._backup(self.b.local_backups[stage][piece], stream)
        self._run(self.b.local[stage][piece:piece + 1])

    def stage_barrier(self, stage: int) -> None:
        """Order what stage `stage` reads after what earlier stages wrote on this process (on the host: done)."""

    def drain(self) -> None:
        """Return once every round and local copy of this process is done (or raise after the timeout)."""

    def commit(self) -> None:
        """Write staged bytes and deferred local copies into the destination tensors."""
        self._run([self.b.commit, self.b.deferred])
        apply_shifts(self.b.shifts)


class HostRunner(RoundRunner):
    """CPU tensors over gloo: copies run on this thread while the transport moves earlier rounds."""

    def pack(self, pos: int) -> None:
        self._run(self.b.packs[pos])
        self._sum(pos, "to")  # what leaves, as it leaves

    def post(self, pos: int):
        self._backup(self.b.backups[pos])  # receives write only after this round is posted
        return pos, self.ex.comm.post(self._ops(pos))

    def complete(self, pending) -> None:
        pos, works = pending
        timeout = timedelta(seconds=self.ex.timeout)
        for w in works:
            try:
                w.wait(timeout)
            except Exception as e:
                raise ExecutionError(self.ex._failure(f"{self.describe(pos)} did not complete: {e}")) from e
        self._sum(pos, "from")  # what arrived, before it is scattered
        self._run(self.b.scatters[pos])


class CudaRunner(RoundRunner):
    """GPU tensors over NCCL: pack, transfer, scatter and local copies on their own streams, ordered by events;
    the host only enqueues, then polls each round's completion event against the timeout."""

    def __init__(self, ex, kept: Buffers) -> None:
        super().__init__(ex, kept)
        device = self.b.device
        if kept.streams is None or kept.streams["pack"].device != device:
            kept.streams = {k: torch.cuda.Stream(device) for k in ("pack", "scatter", "local", "post")}
        self.streams = kept.streams
        entry = torch.cuda.current_stream(device).record_event()
        for st in self.streams.values():
            st.wait_event(entry)  # the caller's writes to the source tensors come first
        self.slot_owner: dict[int, dict] = {}
        self.done: list[tuple] = []  # (event, round position), in order
        self.local_done: dict[int, torch.cuda.Event] = {}
        self.last_scatter: torch.cuda.Event | None = None
        self.packed: torch.cuda.Event | None = None

    def pack(self, pos: int) -> None:
        self._keep_up()
        prev = self.slot_owner.get(pos % self.ex.depth)
        st = self.streams["pack"]
        with torch.cuda.stream(st):
            if prev is not None:
                for w in prev["works"]:
                    w.wait()  # the slot's earlier sends have left
            self._run(self.b.packs[pos])
            self._sum(pos, "to")  # on the pack stream, before the slot is sent (and reused)
            self.packed = st.record_event()

    def post(self, pos: int):
        slot = pos % self.ex.depth
        prev = self.slot_owner.get(slot)
        post = self.streams["post"]
        post.wait_event(self.packed)
        if prev is not None:
            post.wait_event(prev["scattered"])  # the slot's earlier receives were scattered
        ops = self._ops(pos)
        with torch.cuda.stream(post):
            self._backup(self.b.backups[pos], post)  # before this round's receives write
            works = self.ex.comm.post(ops)
        pending = {"pos": pos, "works": works, "scattered": None}
        self.slot_owner[slot] = pending
        return pending

    def complete(self, pending) -> None:
        st = self.streams["scatter"]
        with torch.cuda.stream(st):
            for w in pending["works"]:
                w.wait()
            self._sum(pending["pos"], "from")  # what arrived, before it is scattered (and the slot reused)
            self._run(self.b.scatters[pending["pos"]])
            ev = st.record_event()
        pending["scattered"] = self.last_scatter = ev
        self.done.append((ev, pending["pos"]))

    def _keep_up(self) -> None:
        """Wait (bounded) until the GPU has finished the round HOST_LEAD rounds back: with a dead peer, a full CUDA
        launch queue would otherwise block the host in a kernel launch, out of reach of the timeout."""
        if len(self.done) < HOST_LEAD:
            return
        ev, pos = self.done[-HOST_LEAD]
        if not ev.query():
            self._wait([ev], [self.describe(pos)])

    def _wait(self, events: list, what) -> None:
        try:
            wait_events(events, self.ex.timeout, what)
        except ExecutionError as e:
            raise ExecutionError(self.ex._failure(str(e))) from None

    def local(self, stage: int, piece: int, stream=None) -> None:
        st = self.streams["local"]
        with torch.cuda.stream(st):
            super().local(stage, piece, st)
            self.local_done[stage] = st.record_event()

    def stage_barrier(self, stage: int) -> None:
        # relays and local copies of this stage read what earlier stages wrote on this process
        for name in ("pack", "local"):
            if self.last_scatter is not None:
                self.streams[name].wait_event(self.last_scatter)
            if stage - 1 in self.local_done:
                self.streams[name].wait_event(self.local_done[stage - 1])

    def drain(self) -> None:
        events = [e for e, _ in self.done] + list(self.local_done.values())
        stages = list(self.local_done)

        def what(i: int) -> str:
            return self.describe(self.done[i][1]) if i < len(self.done) else \
                f"local copies of stage {stages[i - len(self.done)]}"
        self._wait(events, what)

    def commit(self) -> None:
        cur = torch.cuda.current_stream(self.b.device)
        for st in self.streams.values():
            cur.wait_stream(st)
        super().commit()
        cur.synchronize()

    def _restore_log(self) -> int:
        # after the abort: once nothing of this refit runs on our streams (bounded), put back every region whose
        # backup completed (one whose backup did not run was never written: its writes are ordered after it)
        ends = [st.record_event() for st in self.streams.values()]
        try:
            wait_events(ends, self.ex.timeout, [f"{name} stream" for name in self.streams])
        except ExecutionError as e:
            raise ExecutionError(f"could not restore the previous weights: {e}; destination tensors may be "
                                 f"partly written") from None
        done = [program for ev, program in self.undo_log if ev.query()]
        with torch.cuda.stream(self.streams["local"]):
            self._run(done)
        self.streams["local"].synchronize()
        return len(done)


__all__ = ["RoundViews", "Buffers", "CudaRunner", "RoundRunner", "HostRunner", "abort"]
