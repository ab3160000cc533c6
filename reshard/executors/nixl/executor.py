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
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch

from ...errors import ExecutionError
from ...planner import Plan
from ..base import RankTensors, close_within
from ..binding import Binding
from ..checksum import Streams, algorithm, mismatch
from ..copies import DST, SHADOW, SRC, WIRE
from ..exchange import Exchange
from ..guard import check_memory, check_ops
from ..local import apply_shifts, check_tensors, in_units, shift_views, torch_dtype
from ..stats import RefitStats, ops_landing
from ..views import BoundCopies, Memory, bind
from ..voted import VotedExecutor
from .agent import describe, is_nixl_error
from .connection import Connection
from .descriptors import memory_name
from .options import NixlOptions
from .schedule import Link, LinkSchedule, build_schedule

READY, DONE = b"R", b"D"
_QUARANTINE: list[torch.Tensor] = []  # arenas of failed executors: a late remote write must not hit freed memory


def _device_of(src: RankTensors, dst: RankTensors) -> torch.device:
    devices = {t.device for side in (src, dst) for ts in side.values() for t in ts.values()}
    if len(devices) > 1:
        raise ExecutionError(f"a NIXL executor's tensors must all be on one device; got {sorted(map(str, devices))}")
    return devices.pop() if devices else torch.device("cpu")


class NixlExecutor(VotedExecutor):
    """One process's part of a plan over NIXL, built once and run at every refit (the protocol of
    executors.base). `store`: a torch.distributed store every process of the binding reaches."""

    name = "nixl"
    label = "NIXL"

    def __init__(self, plan: Plan, binding: Binding, process: int, src: RankTensors, dst: RankTensors, *,
                 store: Any, options: NixlOptions | None = None, namespace: str = "default") -> None:
        self.plan, self.binding, self.process = plan, binding, process
        binding.check(plan.src.num_ranks, plan.dst.num_ranks)
        check_ops(plan)  # before the schedule indexes anything with the plan's ops
        self.options = options = options or NixlOptions()
        self.timeout, self.poll_max_s = options.timeout, options.poll_max_s
        self.num_processes = binding.num_processes
        self.device = _device_of(src, dst)
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
        s, name = self.schedule, f"{namespace}:{process}"
        book = {"process": process, "agent": name, "plan": plan.digest, "binding": binding.to_dict(),
                "options": options.shared(), "direction": s.direction, "pack_below": self.pack_below,
                "land_below": self.land_below, "mem": self.mem_type, "device": self.device_id,
                "addresses": {memory_name(k, i): self._address(k, i) for k, i in s.exposed}}
        regions = [(t.data_ptr(), t.numel() * self.itemsize) for t in
                   (self._memory(k, i) for k, i in s.exposed if k in (SRC, DST))]
        if s.arena_numel:
            regions.append((self.arena.data_ptr(), s.arena_numel * self.itemsize))
        # the agent, its registrations, its peers and a prepared transfer per link it initiates (once)
        self.connection = Connection(s, name, self.exchange, book, regions, self.itemsize, options.timeout,
                                     options.progress_delay_us)

    # --- construction --------------------------------------------------------------------------------
    def _check_and_bind(self, src: RankTensors, dst: RankTensors) -> None:
        plan, s = self.plan, self.schedule
        problems = []
        for ids, table, given, side in ((s.src_ids, plan.src_tensors, src, "source"),
                                        (s.dst_ids, plan.dst_tensors, dst, "destination")):
            for i in ids:
                rank, name = table.ranks[i], table.names[i]
                if rank not in given or name not in given[rank]:
                    problems.append(f"{side} rank {rank} tensor {name!r} is missing (process {self.process} "
                                    f"plays that rank in {self.binding})")
        if problems:
            raise ExecutionError("tensors do not match the plan:\n  - " + "\n  - ".join(problems[:20]))
        check_tensors(plan, {r: src[r] for r in src}, {r: dst[r] for r in dst})
        check_memory(src, dst)
        src, dst = in_units(plan, src, dst)  # tensors kept in a wider dtype, seen in the plan's
        self.src_flat = {i: src[plan.src_tensors.ranks[i]][plan.src_tensors.names[i]].view(-1) for i in s.src_ids}
        self.dst_flat = {i: dst[plan.dst_tensors.ranks[i]][plan.dst_tensors.names[i]].view(-1) for i in s.dst_ids}
        dtype = torch_dtype(plan.dst.dtype)
        self.arena = torch.empty(s.arena_numel, dtype=dtype, device=self.device)
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
        program = lambda c: bind(c, views, self.itemsize)  # noqa: E731
        self._pack = {k: program(v) for k, v in s.pack.items()}
        self._arrive = {k: program(v) for k, v in s.arrive.items()}
        self._local = [program(c) for c in s.local]
        self._commit_program = program(s.commit)
        self._shifts = shift_views(plan, self.dst_flat)  # value shifts of this process's destination blocks

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
        self._move(v, deadline)

    def _describe(self, e: Exception) -> str:
        return describe(e) if is_nixl_error(e) else f"{type(e).__name__}: {e}"

    def _commit(self) -> None:
        self._run(self._commit_program)
        apply_shifts(self._shifts)
        self._dirty = self._dirty or bool(self._shifts)
        self._sync()

    def _forget(self, previous: int) -> None:
        self.exchange.forget(previous, tuple(f"v{previous}/sum/{link.id}" for link in self.schedule.incoming)
                             if self.options.checksum else ())

    def _move(self, v: int, deadline: float) -> None:
        s, conn, read = self.schedule, self.connection, self.schedule.direction == "read"
        stage_left = defaultdict(int)
        for link in s.incoming:
            stage_left[link.stage] += 1
        waiting_in = {link.id: link for link in s.incoming}
        waiting_out = {link.id: link for link in s.outgoing}
        unstarted_out = sorted(s.outgoing, key=lambda link: link.stage)
        posted: dict[int, Link] = {}
        frontier = 0
        if s.num_stages:
            self._run(self._local[0])
            self._sync()
        if not read:
            for link in s.incoming:  # my landing memory is free: senders may write
                self._notify(link.sender, READY, v, link)
        next_failure_check = time.monotonic() + 0.05
        sleep = 2e-5
        while True:
            progress = False
            self._drain_notifications(v)
            # 1. start outgoing links whose source bytes are in place
            still = []
            for link in unstarted_out:
                if link.stage > frontier or (not read and not self._take(READY, v, link)):
                    still.append(link)
                    continue
                if link.id in self._pack:
                    self._run(self._pack[link.id])
                    self._sync()
                if self.options.checksum:  # before a peer can read or receive the link's bytes
                    self.exchange.store.set(f"v{v}/sum/{link.id}", self._link_digest(link, "send"))
                if read:
                    self._notify(link.receiver, READY, v, link)
                else:
                    self._post(link, v)
                    posted[link.id] = link
                progress = True
            unstarted_out = still
            # 2. READ: post every incoming link whose sender is ready, before waiting on any
            if read:
                for link in list(waiting_in.values()):
                    if link.id not in posted and self._take(READY, v, link):
                        self._post(link, v)
                        posted[link.id] = link
                        progress = True
            # 3. completions of the transfers this process posted
            for lid, link in list(posted.items()):
                state = conn.state(link)
                if state == "DONE":
                    del posted[lid]
                    progress = True
                    if read:
                        self._arrived(link, waiting_in, stage_left, v)
                    else:
                        del waiting_out[lid]
                elif state != "PROC":
                    raise ExecutionError(f"{link} with process {link.peer(self.process)} ended in state {state}")
            # 4. completions announced by peers
            for link in list(waiting_out.values() if read else waiting_in.values()):
                if self._take(DONE, v, link):
                    progress = True
                    if read:
                        del waiting_out[link.id]
                    else:
                        self._arrived(link, waiting_in, stage_left, v)
            # 5. stages whose incoming links are all in: run the next stage's local copies
            while frontier < s.num_stages and stage_left[frontier] == 0:
                frontier += 1
                if frontier < s.num_stages:
                    self._run(self._local[frontier])
                    self._sync()  # relays of the next stage may read what these copies wrote
                progress = True
            if not waiting_in and not waiting_out and not unstarted_out and frontier >= s.num_stages:
                return
            now = time.monotonic()
            if now > deadline:
                raise ExecutionError(f"timed out after {self.options.timeout:.1f} s, "
                                     + self._pending(waiting_in, waiting_out, posted, unstarted_out, read))
            if now > next_failure_check:
                reason = self.exchange.failure(v)
                if reason is not None:
                    raise ExecutionError(f"another process failed first ({reason}) while this one was waiting for: "
                                         + self._pending(waiting_in, waiting_out, posted, unstarted_out, read))
                next_failure_check = now + 0.05
            if progress:
                sleep = 2e-5
            else:
                time.sleep(sleep)
                sleep = min(sleep * 2, self.options.poll_max_s)

    def _arrived(self, link: Link, waiting_in: dict[int, Link], stage_left: dict[int, int], v: int) -> None:
        if self.options.checksum:
            sent = self.exchange.store.get(f"v{v}/sum/{link.id}").decode()
            got = self._link_digest(link, "recv")
            if sent != got:
                raise ExecutionError(mismatch(f"{link} from process {link.sender}", sent, got))
        if link.id in self._arrive:
            self._run(self._arrive[link.id])
            self._sync()
        del waiting_in[link.id]
        stage_left[link.stage] -= 1

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

    def _pending(self, waiting_in: dict[int, Link], waiting_out: dict[int, Link], posted: dict[int, Link],
                 unstarted_out: list[Link], read: bool) -> str:
        parts = []
        for link in waiting_in.values():
            if link.id in posted:
                parts.append(f"{link}: transfer still in progress")
            elif read:
                parts.append(f"{link}: no ready notification from process {link.sender}")
            else:
                parts.append(f"{link}: no done notification from process {link.sender}")
        for link in unstarted_out:
            parts.append(f"{link}: " + ("no ready notification from process " + str(link.receiver)
                                        if not read else "earlier stages of this process not complete"))
        for link in waiting_out.values():
            if link in unstarted_out:
                continue
            if link.id in posted:
                parts.append(f"{link}: transfer still in progress")
            elif read:
                parts.append(f"{link}: process {link.receiver} has not finished reading")
        shown = "; ".join(parts[:8]) + (f"; and {len(parts) - 8} more" if len(parts) > 8 else "")
        return f"waiting for: {shown}" if parts else "waiting for the local copies"

    def _run(self, program: BoundCopies) -> None:
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
        self.connection.drop_transfers()

    def _stats(self, v: int, seconds: float, phases: dict[str, float]) -> RefitStats:
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

