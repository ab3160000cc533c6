"""Run a plan over NIXL (UCX backend) between processes, refit after refit, with staged commit.

Every process of a binding builds one `NixlExecutor` with the same plan, binding and options, its own tensors
and a shared torch.distributed store, then calls `refit()` at every weight update. Lifecycle:

  1. construction (once): this process's schedule is derived from the plan (schedule.py: links, pieces,
     packing, shadows); its tensors are checked against the plan and its copy programs bound to them; then
     the NIXL side is set up (connection.py): one agent; the tensors that peers address and one staging
     arena (shadows, packed buffers) registered; the agent's metadata and a JSON address book to the store,
     peers' read back and checked (same plan digest, binding and options); a prepared transfer per link this
     process initiates. Nothing of this is repeated by a refit;
  2. refit(version): the source tensors hold the new weights when it is called on a sender. The first refit
     first waits until every peer has left set-up (no NIXL traffic to an agent still loading its peers). Notifications
     carry the version: READ (receiver pulls): a sender announces "ready v" per link once its bytes are in
     place (at once for trainer ranks, after its own earlier stages for relays); the receiver posts that
     link's prepared READ as soon as its ready arrives, to every peer before waiting on any, and the READ
     notifies the sender "done v" when it completes. WRITE (sender pushes): the receiver announces "ready v"
     (its landing memory is free), the sender posts its WRITE with notification "done v", which NIXL delivers
     after the data. Local copies (ranks of one process) run beside, stage by stage;
  3. verify: every link of this process completed, in this version; then the process counts itself done in
     the store and waits until every process of the binding is (or one reports a failure): the refit around
     the transfer (versions, vote, commit, failure) is executors.voted's, shared with the shared-memory executor;
  4. commit (staged): shadows and packed receive buffers are copied into the destination tensors, with the
     local copies kept for commit. Then refit returns `RefitStats`.
  5. close(): handles, descriptor lists, peers and registrations are released (also by `with`).

Versions. Each refit has a version (default: the previous one + 1), carried by every notification; a
notification of another version for the link being waited on means the processes disagree and is an error, so
a receiver never reads a generation other than the one it was asked for.

Staging and its memory cost (staged=True, the default). Destination tensors that receive direct bytes from a
peer, or that this process forwards to others, get a shadow of their full size in the arena; packed links get
their own receive buffer (and the sender a send buffer) of the link's size. So the arena holds at most this
process's destination share once more, plus the packed bytes (`RefitStats.staging_bytes`), and a refit copies
the received bytes once more at commit. A refit that fails or times out never reaches the commit, so every
destination tensor keeps its previous contents. staged=False writes into the destination tensors directly
(no shadows, no commit copy); a failed refit then leaves them partly written.

Failure. NIXL raises at once on a dead peer it talks to; a frozen peer never completes and NIXL has no
deadline, so every wait here is bounded by the refit's `timeout` (from the start of the refit). A process that
fails writes its reason to the store, and the others stop waiting at their next poll; a process that depends
on a dead one without talking to it gives up at the vote. The error is an ExecutionError naming the link, the
peer and what was awaited. After a failure the executor is unusable: close it and build a new one (with a new
namespace). Its staging arena is kept alive until the process exits, since a peer may still be writing to it.

Delta refits: `delta=DeltaPolicy(...)` (CPU tensors; executors.nixl.delta): dense keyframes through the links
above, deltas as one WRITE of the payload's bytes per pair into the receiver's registered inbox.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch

from ...errors import ExecutionError
from ...planner import Plan
from ...polling import poll
from ..base import RankTensors, close_within
from ..binding import Binding
from ..checksum import Streams, algorithm, mismatch
from ..copies import DST, SHADOW, SRC, WIRE
from ..delta import DeltaPolicy, DeltaReport
from ..exchange import Exchange
from ..preflight import check_ops
from ..reference import apply_shifts
from ..prepared import Prepared
from ..stats import RefitStats, ops_landing
from ..views import CopyViews, Memory, view_copies
from ..voted import VotedExecutor
from .agent import describe, is_nixl_error
from .connection import Connection
from .delta import NixlDelta
from .descriptors import memory_name
from .options import NixlOptions
from .schedule import Link, LinkSchedule, build_schedule

READY, DONE = b"R", b"D"
_QUARANTINE: list[torch.Tensor] = []  # arenas of failed executors: a late remote write must not hit freed memory


class NixlExecutor(VotedExecutor):
    """One process's part of a plan over NIXL, built once and run at every refit (the protocol of
    executors.base). `store`: a torch.distributed store every process of the binding reaches. `delta`: a
    `DeltaPolicy` (executors.delta): refits move only the changed elements, with dense keyframes as it says (CPU
    tensors; executors.nixl.delta); `last_delta` says what each moved."""

    name = "nixl"
    label = "NIXL"

    def __init__(self, plan: Plan, binding: Binding, process: int, src: RankTensors, dst: RankTensors, *,
                 store: Any, options: NixlOptions | None = None, namespace: str = "default",
                 delta: "DeltaPolicy | None" = None) -> None:
        self.plan, self.binding, self.process = plan, binding, process
        binding.check(plan.src.num_ranks, plan.dst.num_ranks)
        check_ops(plan)  # before the schedule indexes anything with the plan's ops
        self.options = options = options or NixlOptions()
        self.timeout, self.poll_max_s = options.timeout, options.poll_max_s
        self.num_processes = binding.num_processes
        self.prepared = Prepared(plan, src, dst)
        self.device = self.prepared.device or torch.device("cpu")
        on_gpu = self.device.type == "cuda"
        self.mem_type = "VRAM" if on_gpu else "DRAM"
        self.device_id = (self.device.index or 0) if on_gpu else 0
        self.pack_below = options.pack_threshold(on_gpu)
        self.land_below = options.land_threshold(on_gpu)
        self.schedule: LinkSchedule = build_schedule(plan, binding, process, options, self.pack_below,
                                                     self.land_below)
        self.staged = self.schedule.staged
        self.itemsize = plan.itemsize
        self._check_and_bind(src, dst)
        self._num_ops = ops_landing(plan, binding.dst_ranks_of(process))
        self._start_versions()
        self._dirty = True  # copies may be in flight on the GPU (the caller's, at first)
        self._inbox: dict[tuple[bytes, int], set[int]] = defaultdict(set)
        self._peers_set_up = False  # every peer has left set-up (checked once, at the first refit)
        self.exchange = Exchange(store, namespace)
        self._delta = None if delta is None else NixlDelta(self, delta)
        s, name = self.schedule, f"{namespace}:{process}"
        book = {"process": process, "agent": name, "plan": plan.digest, "binding": binding.to_dict(),
                "options": options.shared(), "direction": s.direction, "pack_below": self.pack_below,
                "land_below": self.land_below, "mem": self.mem_type, "device": self.device_id,
                "addresses": {memory_name(k, i): self._address(k, i) for k, i in s.exposed},
                **(self._delta.book() if self._delta is not None else {"delta": None})}
        regions = [(t.data_ptr(), t.numel() * self.itemsize) for t in
                   (self._memory(k, i) for k, i in s.exposed if k in (SRC, DST))]
        if s.arena_numel:
            regions.append((self.arena.data_ptr(), s.arena_numel * self.itemsize))
        if self._delta is not None:
            regions += self._delta.regions()
        # the agent, its registrations, its peers and a prepared transfer per link it initiates (once)
        self.connection = Connection(s, name, self.exchange, book, regions, self.itemsize, options.timeout,
                                     options.progress_delay_us)

    # --- construction --------------------------------------------------------------------------------
    def _check_and_bind(self, src: RankTensors, dst: RankTensors) -> None:
        plan, s = self.plan, self.schedule
        problems = [f"{side} rank {table.ranks[i]} tensor {table.names[i]!r} is missing (process {self.process} "
                    f"plays that rank in {self.binding})"
                    for ids, table, flat, side in ((s.src_ids, plan.src_tensors, self.prepared.src_flat, "source"),
                                                   (s.dst_ids, plan.dst_tensors, self.prepared.dst_flat, "destination"))
                    for i in ids if i not in flat]
        if problems:
            raise ExecutionError("tensors do not match the plan:\n  - " + "\n  - ".join(problems[:20]))
        self.src_flat, self.dst_flat = self.prepared.src_flat, self.prepared.dst_flat
        self.arena = torch.empty(s.arena_numel, dtype=self.prepared.dtype, device=self.device)
        arena = self.arena

        def memory(kind: int, ident: int) -> torch.Tensor:
            if kind == SRC:
                return self.src_flat[ident]
            if kind == DST:
                return self.dst_flat[ident]
            off, n = s.arena[(kind, ident)]
            return arena.narrow(0, off, n)

        self._memory = memory
        # copy programs folded and bound once: views built here, each refit only launches them
        views = Memory(memory, self.itemsize)
        program = lambda c: view_copies(c, views, self.itemsize)  # noqa: E731
        self._pack = {k: program(v) for k, v in s.pack.items()}
        self._arrive = {k: program(v) for k, v in s.arrive.items()}
        self._local = [program(c) for c in s.local]
        self._commit_program = program(s.commit)
        self._shifts = self.prepared.shifts()  # value shifts of this process's destination blocks

    def _address(self, kind: int, ident: int) -> int:
        if kind in (SHADOW, WIRE):
            return self.arena.data_ptr() + self.schedule.arena[(kind, ident)][0] * self.itemsize
        return self._memory(kind, ident).data_ptr()

    # --- a refit -------------------------------------------------------------------------------------
    def _transfer(self, v: int, deadline: float) -> None:
        self._dirty = True
        self._sync()  # the caller's writes into the source tensors are done before anyone reads them
        if not self._peers_set_up:
            # a trainer process other than the driver starts refitting as soon as its own init returns, while the
            # engines' workers may still be setting up (why that matters: docs/guides/reliability.md)
            self.exchange.wait_set_up(list(self.schedule.peers), v, deadline, self.poll_max_s)
            self._peers_set_up = True
        if self._delta is not None and not self._delta.keyframe(v, deadline):
            self._delta.transfer(v, deadline)
            return
        self._move(v, deadline)

    @property
    def last_delta(self) -> "DeltaReport | None":
        """What this process sent in the last refit, with the `delta` option (executors.delta.DeltaReport)."""
        return None if self._delta is None else self._delta.last

    def _describe(self, e: Exception) -> str:
        return describe(e) if is_nixl_error(e) else f"{type(e).__name__}: {e}"

    def _commit(self) -> None:
        if self._delta is not None and self._delta.commit():
            return
        self._run(self._commit_program)
        apply_shifts(self._shifts)
        self._dirty = self._dirty or bool(self._shifts)
        self._sync()

    def _forget(self, previous: int) -> None:
        self.exchange.forget(previous, (tuple(f"v{previous}/sum/{link.id}" for link in self.schedule.incoming)
                                        if self.options.checksum else ())
                             + (self._delta.keys(previous) if self._delta is not None else ()))

    def _move(self, v: int, deadline: float) -> None:
        """Run the links of refit `v` until every one of this process completed, polling notifications and
        transfer states, each wait bounded by `deadline`."""
        s, st = self.schedule, _Progress(self.schedule)
        if s.num_stages:
            self._run(self._local[0])
            self._sync()
        if not st.read:
            for link in s.incoming:  # my landing memory is free: senders may write
                self._notify(link.sender, READY, v, link)
        progress, next_failure_check = [False], [time.monotonic() + 0.05]

        def step() -> bool:
            self._drain_notifications(v)
            progress[0] = (self._start_outgoing(st, v) | self._post_reads(st, v) | self._completions(st, v)
                           | self._announced(st, v) | self._next_stages(st))
            return st.finished()

        def check() -> bool:  # another process's failure, looked up every 50 ms
            if time.monotonic() > next_failure_check[0]:
                reason = self.exchange.failure(v)
                if reason is not None:
                    raise ExecutionError(f"another process failed first ({reason}) while this one was waiting for: "
                                         + st.pending())
                next_failure_check[0] = time.monotonic() + 0.05
            return progress[0]

        if not poll(step, deadline, first_s=2e-5, most_s=self.options.poll_max_s, between=check):
            raise ExecutionError(f"timed out after {self.options.timeout:.1f} s, " + st.pending())

    def _start_outgoing(self, st: "_Progress", v: int) -> bool:
        """Start outgoing links whose source bytes are in place (WRITE: and whose receiver is ready)."""
        still = []
        for link in st.unstarted_out:
            if link.stage > st.frontier or (not st.read and not self._take(READY, v, link)):
                still.append(link)
                continue
            if link.id in self._pack:
                self._run(self._pack[link.id])
                self._sync()
            if self.options.checksum:  # before a peer can read or receive the link's bytes
                self.exchange.store.set(f"v{v}/sum/{link.id}", self._link_digest(link, "send"))
            if st.read:
                self._notify(link.receiver, READY, v, link)
            else:
                self._post(link, v)
                st.posted[link.id] = link
        progress, st.unstarted_out = len(still) < len(st.unstarted_out), still
        return progress

    def _post_reads(self, st: "_Progress", v: int) -> bool:
        """READ: post every incoming link whose sender is ready, before waiting on any."""
        progress = False
        for link in list(st.waiting_in.values()) if st.read else ():
            if link.id not in st.posted and self._take(READY, v, link):
                self._post(link, v)
                st.posted[link.id] = link
                progress = True
        return progress

    def _completions(self, st: "_Progress", v: int) -> bool:
        """Completions of the transfers this process posted."""
        progress = False
        for lid, link in list(st.posted.items()):
            state = self.connection.state(link)
            if state == "DONE":
                del st.posted[lid]
                progress = True
                if st.read:
                    self._arrived(link, st, v)
                else:
                    del st.waiting_out[lid]
            elif state != "PROC":
                raise ExecutionError(f"{link} with process {link.peer(self.process)} ended in state {state}")
        return progress

    def _announced(self, st: "_Progress", v: int) -> bool:
        """Completions announced by peers (their transfers' done notifications)."""
        progress = False
        for link in list(st.waiting_out.values() if st.read else st.waiting_in.values()):
            if self._take(DONE, v, link):
                progress = True
                if st.read:
                    del st.waiting_out[link.id]
                else:
                    self._arrived(link, st, v)
        return progress

    def _next_stages(self, st: "_Progress") -> bool:
        """Stages whose incoming links are all in: run the next stage's local copies."""
        progress = False
        while st.frontier < self.schedule.num_stages and st.stage_left[st.frontier] == 0:
            st.frontier += 1
            if st.frontier < self.schedule.num_stages:
                self._run(self._local[st.frontier])
                self._sync()  # relays of the next stage may read what these copies wrote
            progress = True
        return progress

    def _arrived(self, link: Link, st: "_Progress", v: int) -> None:
        if self.options.checksum:
            sent = self.exchange.store.get(f"v{v}/sum/{link.id}").decode()
            got = self._link_digest(link, "recv")
            if sent != got:
                raise ExecutionError(mismatch(f"{link} from process {link.sender}", sent, got))
        if link.id in self._arrive:
            self._run(self._arrive[link.id])
            self._sync()
        del st.waiting_in[link.id]
        st.stage_left[link.stage] -= 1

    def _link_digest(self, link: Link, side: str) -> str:
        """The checksum of one side of a link's pieces, in order: the bytes it moves (executors.checksum)."""
        p, sums = link.pieces, Streams(algorithm(self.options.checksum))
        for kind, ident, off, n in zip(p[f"{side}_kind"].tolist(), p[f"{side}_id"].tolist(),
                                       p[f"{side}_off"].tolist(), p["numel"].tolist()):
            sums.update(0, self._memory(kind, ident).narrow(0, off, n))
        return sums.hexdigest(0)

    def _post(self, link: Link, v: int) -> None:
        self.connection.post(link, DONE + f"{v}:{link.id}".encode())

    def _notify(self, peer: int, kind: bytes, v: int, link: Link) -> None:
        self.connection.notify(peer, kind + f"{v}:{link.id}".encode(), link)

    def _drain_notifications(self, v: int) -> None:
        for m in self.connection.notifications():
            kind, rest = m[:1], m[1:]
            try:
                mv, lid = (int(x) for x in rest.split(b":"))
            except ValueError:
                continue  # not ours
            if kind in (READY, DONE) and mv >= v:  # else a stale version's leftover
                self._inbox[(kind, lid)].add(mv)

    def _take(self, kind: bytes, v: int, link: Link) -> bool:
        """Consume notification (kind, v) of a link; another version there means the processes disagree."""
        versions = self._inbox.get((kind, link.id))
        if not versions:
            return False
        if v in versions:
            versions.discard(v)
            return True
        other = sorted(versions)
        what = "ready" if kind == READY else "done"
        raise ExecutionError(f"process {link.peer(self.process)} announced {what} of version {other[0]} for {link} "
                             f"while process {self.process} runs version {v}: every process must refit the same "
                             f"versions")

    def _run(self, program: CopyViews) -> None:
        if len(program):
            with torch.no_grad():
                program.run()
            self._dirty = True

    def _sync(self) -> None:
        """Wait for this process's copies on the GPU before a peer may read what they wrote."""
        if self.device.type == "cuda" and self._dirty:
            torch.cuda.synchronize(self.device)
        self._dirty = False

    def _abandon(self) -> None:
        if self.arena.numel():
            _QUARANTINE.append(self.arena)
        if self._delta is not None:
            _QUARANTINE.extend(self._delta.buffers())
        self.connection.drop_transfers()

    def _stats(self, v: int, seconds: float, phases: dict[str, float]) -> RefitStats:
        if self._delta is not None and not self._delta.last.keyframe:
            return self._delta.stats(v, seconds, phases, self.staged)
        s, size = self.schedule, self.itemsize
        sent: dict[int, int] = defaultdict(int)
        received: dict[int, int] = defaultdict(int)
        for link in s.outgoing:
            sent[link.receiver] += link.numel * size
        for link in s.incoming:
            received[link.sender] += link.numel * size
        return RefitStats(
            executor=self.name, process=self.process, version=v, seconds=seconds, phases=phases, staged=s.staged,
            ops=self._num_ops, bytes_sent=dict(sent), bytes_received=dict(received), local_bytes=s.local_numel * size,
            staging_bytes=s.staging_bytes, transfers=len(s.incoming) + len(s.outgoing),
            checksum=algorithm(self.options.checksum) or "", direction=s.direction,
            packed_transfers=sum(link.packed for link in s.links),
            descriptors=sum(link.num_pieces for link in s.links if s.initiates(link)))

    # --- teardown ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release NIXL resources; the tensors stay the caller's."""
        if not self._closed:
            self._closed = True
            if not close_within(self.connection.release, self.options.timeout, "releasing the NIXL agent"):
                _QUARANTINE.append(self.arena)  # a release still running may yet touch the registered memory
                if self._delta is not None:
                    _QUARANTINE.extend(self._delta.buffers())


class _Progress:
    """Where one refit's links stand on this process (NixlExecutor._move)."""

    def __init__(self, s: LinkSchedule) -> None:
        self.read, self.num_stages = s.direction == "read", s.num_stages
        self.stage_left: dict[int, int] = defaultdict(int)
        for link in s.incoming:
            self.stage_left[link.stage] += 1
        self.waiting_in = {link.id: link for link in s.incoming}
        self.waiting_out = {link.id: link for link in s.outgoing}
        self.unstarted_out = sorted(s.outgoing, key=lambda link: link.stage)
        self.posted: dict[int, Link] = {}
        self.frontier = 0

    def finished(self) -> bool:
        return not (self.waiting_in or self.waiting_out or self.unstarted_out) and self.frontier >= self.num_stages

    def pending(self) -> str:
        """What this process still waits for, in words."""
        read, posted = self.read, self.posted
        parts = []
        for link in self.waiting_in.values():
            if link.id in posted:
                parts.append(f"{link}: transfer still in progress")
            elif read:
                parts.append(f"{link}: no ready notification from process {link.sender}")
            else:
                parts.append(f"{link}: no done notification from process {link.sender}")
        for link in self.unstarted_out:
            parts.append(f"{link}: " + ("no ready notification from process " + str(link.receiver)
                                        if not read else "earlier stages of this process not complete"))
        for link in self.waiting_out.values():
            if link in self.unstarted_out:
                continue
            if link.id in posted:
                parts.append(f"{link}: transfer still in progress")
            elif read:
                parts.append(f"{link}: process {link.receiver} has not finished reading")
        shown = "; ".join(parts[:8]) + (f"; and {len(parts) - 8} more" if len(parts) > 8 else "")
        return f"waiting for: {shown}" if parts else "waiting for the local copies"
