"""Run a plan over NIXL (UCX backend) between processes, refit after refit, with staged commit.

Every process of a binding builds one `NixlExecutor` with the same plan, binding and options, its own tensors and
a shared torch.distributed store, then calls `refit()` at every weight update.

  1. construction (once): this process's schedule (schedule.py: links, pieces, packing, shadows), its tensors
     checked and its copy programs bound; then the NIXL side (connection.py): an agent, the registered memory,
     address books exchanged through the store and checked, a prepared transfer per link this process initiates;
  2. refit(v): the first one waits until every peer has left set-up. READ (the receiver pulls): a sender
     notifies "ready v" per link once its bytes are in place, the receiver posts the link's READ, which notifies
     the sender "done v". WRITE (the sender pushes): the receiver notifies "ready v" (its landing memory is free)
     and the sender posts its WRITE with "done v", delivered after the data. Local copies run stage by stage;
  3. verify, vote, commit and failure are executors.voted's: staged commit copies shadows and packed receive
     buffers into the destination tensors, so a failed refit leaves them unchanged; staged=False writes in place;
  4. close(): handles, descriptor lists, peers and registrations are released (also by `with`).

A notification of another version for the awaited link is an error: a receiver never reads another generation.
Every wait is bounded by `timeout` from the start of the refit (NIXL has no deadline for a frozen peer); a
failing process writes its reason to the store and the others stop at their next poll. After a failure close the
executor and build a new one (new namespace); its arena stays alive, since a peer may still write to it.
Delta refits (`delta=`, CPU tensors): dense keyframes through the links, deltas as one WRITE per pair (NixlDelta).
"""
from __future__ import annotations

import time
from collections import Counter, defaultdict
from typing import Any

import torch

from ...errors import ExecutionError
from ...planner import Plan
from ...polling import poll
from ..base import RankTensors, RefitStats, close_within
from ..binding import Binding
from ..checksum import Streams, mismatch
from ..copies import DST, SRC, Memory, view_copies
from ..delta import DeltaError, DeltaPolicy, VotedDelta, payload_bound
from ..exchange import Exchange
from ..voted import VotedExecutor
from .connection import Connection, memory_name
from .options import NixlOptions
from .schedule import Link, LinkSchedule, build_schedule

READY, DONE = b"R", b"D"
_QUARANTINE: list[torch.Tensor] = []  # arenas of failed executors: a late remote write must not hit freed memory


class NixlExecutor(VotedExecutor):
    """One process's part of a plan over NIXL, built once and run at every refit (the protocol of
    executors.base). `store`: a torch.distributed store every process reaches. `delta`: a `DeltaPolicy`
    (executors.delta; CPU tensors): refits move only the changed elements; `last_delta` says what each moved."""

    name = "nixl"
    label = "NIXL"

    def __init__(self, plan: Plan, binding: Binding, process: int, src: RankTensors, dst: RankTensors, *,
                 store: Any, options: NixlOptions | None = None, namespace: str = "default",
                 delta: "DeltaPolicy | None" = None) -> None:
        self.options = options = options or NixlOptions()
        self._open(plan, binding, process, src, dst, options.timeout, options.poll_max_s, options.checksum)
        self.num_processes = binding.num_processes
        on_gpu = self.device.type == "cuda"
        self.pack_below, self.land_below = options.thresholds(on_gpu)
        self.schedule = s = build_schedule(plan, binding, process, options, self.pack_below, self.land_below)
        self.staged, self.part = s.staged, s.part
        self._bind()
        self._inbox: dict[tuple[bytes, int], set[int]] = defaultdict(set)
        self._peers_set_up = False  # every peer has left set-up (checked once, at the first refit)
        self.exchange = Exchange(store, namespace)
        self._delta = None if delta is None else NixlDelta(self, delta)
        name = f"{namespace}:{process}"
        book = {"process": process, "agent": name, "plan": plan.digest, "binding": binding.to_dict(),
                "options": options.shared(), "direction": s.direction, "pack_below": self.pack_below,
                "land_below": self.land_below, "mem": "VRAM" if on_gpu else "DRAM",
                "device": (self.device.index or 0) if on_gpu else 0,
                "addresses": {memory_name(k, i): self._memory(k, i).data_ptr() for k, i in s.exposed},
                **(self._delta.book() if self._delta is not None else {"delta": None})}
        regions = [(t.data_ptr(), t.numel() * self.itemsize) for t in
                   (self._memory(k, i) for k, i in s.exposed if k in (SRC, DST))]
        if s.arena_numel:
            regions.append((self.arena.data_ptr(), s.arena_numel * self.itemsize))
        if self._delta is not None:
            regions += [(t.data_ptr(), t.numel()) for t in self._delta.buffers()]
        # the agent, its registrations, its peers and a prepared transfer per link it initiates (once)
        self.connection = Connection(s, name, self.exchange, book, regions, self.itemsize, options.timeout,
                                     options.progress_delay_us)

    def _bind(self) -> None:
        """Bind this process's copy programs once."""
        s = self.schedule
        self.arena = arena = torch.empty(s.arena_numel, dtype=self.prepared.dtype, device=self.device)

        def memory(kind: int, ident: int) -> torch.Tensor:
            if kind in (SRC, DST):
                return (self.src_flat if kind == SRC else self.dst_flat)[ident]
            off, n = s.arena[(kind, ident)]
            return arena.narrow(0, off, n)

        self._memory = memory
        views = Memory(memory, self.itemsize)
        program = lambda c: view_copies(c, views, self.itemsize)  # noqa: E731
        self._pack = {k: program(v) for k, v in s.pack.items()}
        self._arrive = {k: program(v) for k, v in s.arrive.items()}
        self._local = [program(c) for c in s.local]
        self._commit_program = program(s.commit)
        self._shifts = self.prepared.shifts()  # value shifts of this process's destination blocks

    def _transfer(self, v: int, deadline: float) -> None:
        self._dirty = True
        self._sync()  # the caller's writes into the source tensors are done before anyone reads them
        if not self._peers_set_up:
            # a trainer process other than the driver starts refitting as soon as its own init returns, while the
            # engines' workers may still be setting up (why that matters: docs/guides/reliability.md)
            self.exchange.wait_set_up(list(self.schedule.part.peers), v, deadline, self.poll_max_s)
            self._peers_set_up = True
        super()._transfer(v, deadline)

    def _keys(self, previous: int) -> tuple[str, ...]:
        return tuple(f"v{previous}/sum/{link.id}" for link in self.schedule.incoming) if self.checksum else ()

    def _move(self, v: int, deadline: float) -> None:
        """Run the links of refit `v` until every one of this process completed, polling notifications and
        transfer states, each wait bounded by `deadline`."""
        s, st = self.schedule, _Progress(self.schedule)
        if s.num_stages:
            self._run(self._local[0], sync=True)
        if not st.read:
            for link in s.incoming:  # my landing memory is free: senders may write
                self._notify(link.sender, READY, v, link)
        progress, next_failure_check = [False], [time.monotonic() + 0.05]

        def step() -> bool:
            self._drain_notifications(v)
            progress[0] = self._advance(st, v) | self._next_stages(st)
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

    def _advance(self, st: "_Progress", v: int) -> bool:
        """One pass over the links: start outgoing links whose stage is reached (packed, summed; READ: the
        receiver told), post the links this process initiates once the peer is ready, and complete links (this
        process's transfers by their state, the peer's by its done notification). Whether anything moved."""
        progress = False
        for link in [link for link in st.unstarted_out if link.stage <= st.frontier]:
            st.unstarted_out.remove(link)
            if link.id in self._pack:
                self._run(self._pack[link.id], sync=True)
            if self.checksum:  # before a peer can read or receive the link's bytes
                self.exchange.store.set(f"v{v}/sum/{link.id}", self._link_digest(link, "send"))
            if st.read:
                self._notify(link.receiver, READY, v, link)
            else:  # WRITE: posted once the receiver's landing memory is free
                st.unposted.append(link)
            progress = True
        for link in [link for link in st.unposted if self._take(READY, v, link)]:
            st.unposted.remove(link)
            self.connection.post(link, DONE + f"{v}:{link.id}".encode())
            st.posted[link.id] = link
            progress = True
        for link in [*st.waiting_in.values(), *st.waiting_out.values()]:
            if link.id in st.posted:
                state = self.connection.state(link)
                if state not in ("DONE", "PROC"):
                    raise ExecutionError(f"{link} with process {link.peer(self.process)} ended in state {state}")
                done = state == "DONE"
            else:
                done = not self.schedule.initiates(link) and self._take(DONE, v, link)
            if done:
                st.posted.pop(link.id, None)
                progress = True
                if link.receiver == self.process:
                    self._arrived(link, st, v)
                else:
                    del st.waiting_out[link.id]
        return progress

    def _next_stages(self, st: "_Progress") -> bool:
        """Stages whose incoming links are all in: run the next stage's local copies."""
        progress = False
        while st.frontier < self.schedule.num_stages and st.stage_left[st.frontier] == 0:
            st.frontier += 1
            if st.frontier < self.schedule.num_stages:  # relays of the next stage may read what these copies wrote
                self._run(self._local[st.frontier], sync=True)
            progress = True
        return progress

    def _arrived(self, link: Link, st: "_Progress", v: int) -> None:
        if self.checksum:
            sent = self.exchange.store.get(f"v{v}/sum/{link.id}").decode()
            got = self._link_digest(link, "recv")
            if sent != got:
                raise ExecutionError(mismatch(f"{link} from process {link.sender}", sent, got))
        if link.id in self._arrive:
            self._run(self._arrive[link.id], sync=True)
        del st.waiting_in[link.id]
        st.stage_left[link.stage] -= 1

    def _link_digest(self, link: Link, side: str) -> str:
        """The checksum of one side of a link's pieces, in order: the bytes it moves (executors.checksum)."""
        p, sums = link.pieces, Streams(self.checksum)
        for kind, ident, off, n in zip(p[f"{side}_kind"].tolist(), p[f"{side}_id"].tolist(),
                                       p[f"{side}_off"].tolist(), p["numel"].tolist()):
            sums.update(0, self._memory(kind, ident).narrow(0, off, n))
        return sums.hexdigest(0)

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
        what = "ready" if kind == READY else "done"
        raise ExecutionError(f"process {link.peer(self.process)} announced {what} of version {min(versions)} for "
                             f"{link} while process {self.process} runs version {v}: every process must refit the "
                             f"same versions")

    def _abandon(self) -> None:
        self._quarantine()
        self.connection.drop_transfers()

    def _quarantine(self) -> None:
        """Keep the registered buffers alive for good: a peer (or a release still running) may yet write them."""
        _QUARANTINE.extend([self.arena, *(self._delta.buffers() if self._delta is not None else ())])

    def _dense_stats(self, **common: Any) -> RefitStats:
        s = self.schedule  # a link's bytes are its peer's ops (the partition's stream)
        return RefitStats(**common, staging_bytes=s.arena_numel * self.itemsize, transfers=len(s.links),
                          direction=s.direction, packed_transfers=sum(link.packed for link in s.links),
                          descriptors=sum(link.num_pieces for link in s.links if s.initiates(link)))

    def close(self) -> None:
        """Release NIXL resources; the tensors stay the caller's."""
        if not self._closed:
            self._closed = True
            if not close_within(self.connection.release, self.options.timeout, "releasing the NIXL agent"):
                self._quarantine()


class NixlDelta(VotedDelta):
    """A NixlExecutor's delta refits (CPU tensors, DRAM): executors.delta.VotedDelta's protocol. Its transport:
    every sender registers an outbox per receiving peer and every receiver an inbox per feeder, each of
    `payload_bound` bytes; the receiver's book publishes its inboxes. A sender WRITEs only the payload's bytes into
    the receiver's inbox (a transfer made for that size); the store carries the size, and the receiver reads the
    inbox in place once the WRITE's notification arrived.

    Raises:
        ExecutionError: GPU tensors, or a plan with fan-out relays.
    """

    def __init__(self, executor: Any, policy: DeltaPolicy) -> None:
        plan, part = executor.plan, executor.schedule.part
        super().__init__(executor, policy, part, executor.checksum, cpu=True)
        self.outbox = {q: torch.empty(payload_bound(plan, ops), dtype=torch.uint8) for q, ops in part.sends_to.items()}
        self.inbox = {f: torch.empty(payload_bound(plan, ops), dtype=torch.uint8)
                      for f, ops in part.receives_from.items()}
        self.notified: set[bytes] = set()  # the WRITE notifications that arrived (_landed)

    def book(self) -> dict[str, Any]:
        """What this process's address book says about its delta refits: the policy and its inboxes."""
        return {"delta": self.policy.keyframe_every,
                "delta_inbox": {str(f): t.data_ptr() for f, t in self.inbox.items()}}

    def buffers(self) -> list[torch.Tensor]:
        """The payload buffers (uint8), registered with the executor's memory and kept alive after a failure."""
        return [*self.outbox.values(), *self.inbox.values()]

    def deliver(self, q: int, payload: torch.Tensor, v: int, deadline: float) -> dict[str, Any]:
        n, box, me = payload.numel(), self.outbox[q], self.ex.process
        if n > box.numel():
            raise ExecutionError(f"a delta of {n} bytes for process {q} exceeds its buffer of {box.numel()}")
        box[:n].copy_(payload)
        remote = self.ex.connection.books[q].get("delta_inbox", {}).get(str(me))
        if remote is None:
            raise ExecutionError(f"process {q} exposes no delta inbox for process {me}")
        self.ex.connection.write(q, box.data_ptr(), int(remote), n, _landed(v, me), deadline, self.ex.poll_max_s,
                                 f"the delta of refit {v}")
        return {}

    def arrived(self, f: int, where: dict[str, Any], n: int, v: int, deadline: float) -> torch.Tensor:
        box = self.inbox[f]
        if n > box.numel():
            raise DeltaError(f"process {f} announced a delta of {n} bytes, more than its inbox of {box.numel()}; "
                             f"nothing was written")
        want = _landed(v, f)

        def landed() -> bool:  # other messages now are a dense refit's stale ones, which it drops too
            self.notified.update(m for m in self.ex.connection.notifications() if m.startswith(b"X"))
            return want in self.notified

        if not poll(landed, deadline, first_s=2e-5, most_s=self.ex.poll_max_s):
            raise ExecutionError(f"timed out waiting for process {f}'s delta to land (its WRITE's notification)")
        self.notified.discard(want)
        return box[:n]


def _landed(v: int, sender: int) -> bytes:
    """The notification of sender's delta WRITE of refit `v`."""
    return f"X{v}:{sender}".encode()


class _Progress:
    """Where one refit's links stand on this process (NixlExecutor._move)."""

    def __init__(self, s: LinkSchedule) -> None:
        self.read, self.num_stages = s.direction == "read", s.num_stages
        self.stage_left = Counter(link.stage for link in s.incoming)  # incoming links not yet in, per stage
        self.waiting_in = {link.id: link for link in s.incoming}
        self.waiting_out = {link.id: link for link in s.outgoing}
        self.unstarted_out = sorted(s.outgoing, key=lambda link: link.stage)
        self.unposted = list(s.incoming) if self.read else []  # links this process posts once the peer is ready
        self.posted: dict[int, Link] = {}
        self.frontier = 0

    def finished(self) -> bool:
        return not (self.waiting_in or self.waiting_out or self.unstarted_out) and self.frontier >= self.num_stages

    def pending(self) -> str:
        """What this process still waits for, in words."""
        read, posted = self.read, self.posted
        parts = [f"{link}: " + ("transfer still in progress" if link.id in posted else
                                f"no {'ready' if read else 'done'} notification from process {link.sender}")
                 for link in self.waiting_in.values()]
        parts += [f"{link}: " + ("earlier stages of this process not complete" if read else
                                 f"no ready notification from process {link.receiver}")
                  for link in self.unstarted_out + ([] if read else self.unposted)]
        parts += [f"{link}: " + ("transfer still in progress" if link.id in posted else
                                 f"process {link.receiver} has not finished reading")
                  for link in self.waiting_out.values()
                  if link not in self.unstarted_out and (link.id in posted or read)]
        shown = "; ".join(parts[:8]) + (f"; and {len(parts) - 8} more" if len(parts) > 8 else "")
        return f"waiting for: {shown}" if parts else "waiting for the local copies"
