"""Run a plan across real processes over torch.distributed: NCCL between GPUs, gloo between CPU processes.

Every process of the refit group builds the executor with the same plan and binding and its own tensors, and
calls `refit` at every weight update; it sends what it owns and receives what it needs. Lifecycle of
`CollectiveExecutor(plan, binding, process, src, dst, group=group).refit()` (the protocol of executors.base):

  1. construction: the binding is checked against the plan and the group; this process's part of the wire
     schedule is built (executors.collective.schedule: streams per peer, buckets, rounds, folded copy programs). Build
     the executor once and call `refit` at every weight update;
  2. prepare: this process checks its tensors against the plan (executors.prepared: names, shapes, dtype,
     contiguity, device) and views the schedule over them (executors.collective.runners.RoundViews: wire and staging
     buffers, every copy as a prebuilt view). The views are kept and reused while the caller passes the same
     tensors, which is the usual case; `release()` drops them;
  3. preflight: one small all-reduce tells every process whether all are ready and run the same plan,
     binding and bucket size; on any mismatch every process raises before a byte moves. On NCCL the first
     refit then makes the lanes and connects every pair on every lane, off the calling thread and bounded by
     the timeout (executors.collective.connect);
  4. transfer, stage by stage: for each round, pack the round's sends into wire buffers, post the round's
     sends and receives as one batch, and (one round later) wait for them and scatter what arrived; local
     copies (bytes between ranks played by one process) are spread over the stage's rounds; relays of stage
     s+1 start after this process has finished stage s. On GPUs packing, scattering and local copies run on
     their own streams and overlap the transfer; the host only enqueues, then waits for the last round;
  5. verify: every message of this process completed (each was posted with the size the shared schedule
     gives it, and the preflight showed that every process runs that schedule); then one all-reduce says
     whether every process got there;
  6. commit (staged, the default): copy the staged regions into the destination tensors and run the local
     copies kept for commit (undo: only the latter); then return `RefitStats` (bytes per peer, time per step).

Deadlock freedom. Rounds are numbered globally (schedule.py): every process derives the same rounds from the
same plan, binding and bucket size, and each message belongs to exactly one round, in which its sender posts
the send and its receiver the receive. A process posts its rounds in increasing order, and all of one round's
sends and receives at once (`batch_isend_irecv`, non-blocking; on NCCL one group call that progresses every
pair together, so no cycle of blocking sends can form within a round). Induction on the round index: when
every process has finished its rounds before r, every process taking part in round r has posted all of round
r's operations (posting never waits on another process; with `depth` rounds in flight, posting r only waits
for this process's own round r-depth), so every operation of round r finds its match and completes. Round r
travels on lane r mod lanes (a communicator of its own, executors.collective.lanes), which both ends derive from the
round's global index; on one lane, a pair's messages are matched in posting order (NCCL) or by tag = round
(gloo), and both sides post them in the same round order. Lanes run on streams of their own, so a round
never queues behind another lane's; their NCCL kernels (a few dozen thread blocks each) fit on the GPU
together. Relays add only local waits (a process finishes stage s before packing stage s+1), so the
induction still holds.

Staging and its memory cost. By default a destination tensor that receives any bytes from another process (or that
this process forwards from, in fan-out trees) gets a shadow: a staging tensor of the same size into which everything
destined for it is written while the refit is in flight. Only after every process reported a complete transfer (step
5) are the shadows copied into the destination tensors. A failed refit therefore leaves every destination tensor
unchanged. Extra memory: the shadowed destination tensors once more (at most this process's whole destination share,
e.g. 16.4 GB for a TP1 Qwen3-8B replica), held by the executor between calls (one buffer; `release()` frees it), plus
an extra copy of those bytes at commit (a device copy after the transfer; BENCHMARKS.md, NCCL). Destination tensors
fed only by local copies need no shadow: their copies run at commit, straight from the source. `in_place=True` writes
straight into the destination tensors and keeps no shadow; a failed refit then leaves them partly written.

Undo (`undo=True`): the same guarantee for a failed refit as staging, without staging's commit copy. Writes go
straight into the destination tensors, but just before a region is written (on the stream that posts the
round's receives, or the one that runs the local copies) its previous bytes are copied into the tensor's
shadow, overlapping the transfer of the round before. After a failure, once nothing of the refit still runs
on this process's streams, every region whose backup completed is put back (a region whose backup did not
run was never written: its writes are ordered after the backup). Memory: the same shadows as staging. Local
copies into tensors that receive nothing from a peer wait for the commit, as when staged. Unlike staging, a
reader of the destination tensors during the refit sees old and new weights mixed: pause the engine.

Wire buffers: `depth` (3) rounds in flight x the most peers a process has in one round x the bucket size; the
bucket is chosen so that this stays under `memory_cap` on the busiest process.

Failure. A dead or hanging peer makes every surviving process raise ExecutionError within `timeout` seconds
of it starting to wait (a dead gloo peer is usually seen at once: its sockets close): gloo waits carry the
timeout; on GPUs the host polls CUDA events of each round and
gives up after `timeout` seconds without progress, then aborts the group's communicators (its lanes), all at
once (runners.abort says why), waiting for that at most `timeout` more. A process that does not talk to the
failed one directly fails in the verify all-reduce. After a failure the process group is not usable: destroy
and rebuild it.
"""
from __future__ import annotations

import hashlib
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from ...errors import ExecutionError, ReshardError
from ...planner import Plan
from . import connect
from ..base import Executor, RankTensors
from ..binding import Binding
from ..checksum import DIGEST_BYTES, Streams, algorithm, mismatch
from .comm import Comm, comm_for
from ...polling import wait_events
from .runners import Buffers, RoundRunner, Setup, abort, make_runner
from ..preflight import check_ops, refuse_disagreement
from .lanes import NCCL_LANES
from ..prepared import Prepared
from ..delta import DeltaPolicy, DeltaReport
from .delta import CollectiveDelta
from .schedule import (DIRECT_BYTES, GLOO_DIRECT_BYTES, LANES_DIRECT_BYTES, RoundSchedule, bucket_numel_for,
                       build_schedule)
from ..stats import RefitStats, ops_landing, phase_times

DEFAULT_MEMORY_CAP = 2 << 30
CHECKSUM_TAG = (1 << 30) - 1  # the checksum exchange's messages; schedule tags are message numbers below it


def _digest_int(*parts: str) -> int:
    return int(hashlib.sha256("|".join(parts).encode()).hexdigest()[:15], 16)


class CollectiveExecutor(Executor):
    """Runs one plan repeatedly on this process's part of a binding over torch.distributed (gloo, NCCL).

    See the module docstring for the schedule.

    Args:
        plan: the plan.
        binding: which group rank plays each plan rank.
        process: this process's rank in the refit group (None: read from the group).
        src: the tensors of the source ranks this process plays (rank -> name -> tensor).
        dst: the tensors of the destination ranks this process plays; `refit(src=..., dst=...)` may pass others.
        group: the refit group: a group of this process's torch.distributed world (default: the whole world), or a
            `comm.StoreComm` that trainer and inference processes joined by address; binding ranks are ranks in
            it. Every member calls `refit`.
        in_place: write straight into the destination tensors (no staging memory; a failed refit leaves them
            partly written). Default False: staged, committed only once every process has everything.
        undo: write straight into the destination tensors, but first copy each region's previous bytes into a
            shadow (on a side stream, just before the region is written, so the copy overlaps the transfer) and
            put them back if the refit fails. The same memory as staging and the same outcome for a failed refit,
            without staging's commit copy; unlike staging, a reader of the destination tensors during the refit
            sees a mix of old and new weights (pause the engine, as refits usually do).
        memory_cap: bytes of wire buffers per process (`depth` rounds in flight x peers per round x bucket).
        bucket_bytes: the largest message; default as large as `memory_cap` allows.
        timeout: seconds any wait may go without progress before the refit fails with ExecutionError.
        depth: rounds in flight per process; default max(2, lanes).
        direct_bytes: runs of at least this many bytes that are contiguous in the sender's (receiver's) memory
            travel as messages of their own, sent from (received into) the tensors themselves: no pack (scatter)
            copy. None: only messages that happen to be contiguous go direct. "auto": on NCCL 64 MiB on one lane,
            16 MiB on several, where messages are cheaper (on one lane 16 MiB was slower: BENCHMARKS.md, NCCL);
            on gloo 64 KiB (a CPU copy costs more than a message).
        lanes: communicators the rounds are spread over (round r on lane r mod lanes; executors.collective.lanes): NCCL runs
            one communicator's messages one after another, each with a fixed cost, and lanes overlap those costs
            (a refit in which both GPUs send and receive reaches its share of the link with 3 lanes, not with 1;
            BENCHMARKS.md, NCCL). The extra ones are made from the group in the first refit and kept for it; each is
            one more NCCL communicator (its buffers on the GPU). Default: 3 on NCCL, 1 otherwise (gloo has no such
            per-message cost to hide).
        on_round: called with each round's index before it is posted (progress reporting, fault injection in tests).
        checksum: hash the bytes sent to and received from every peer (in round order; True or "sha256", or
            "sum64": executors.checksum), exchange the digests after the transfer and fail the refit on every
            process if one differs, before anything is committed. GPU tensors over NCCL: "sum64" hashes on the GPU
            on the transfer's own streams; "sha256" copies every message to the host (debugging only). Off, nothing
            is hashed or sent. With `delta`, the digests are of the resulting weights (executors.collective.delta).
        delta: a `DeltaPolicy` (executors.delta): refits move only the changed elements, as indices or bitmaps and
            values chosen per op, with dense keyframes as it says (executors.collective.delta); `last_delta`
            reports each refit's encodings and bytes. None (default): every refit dense.

    Raises:
        ExecutionError: options that contradict, tensors that do not match the plan, or (from `refit`) a dead or
            frozen peer or a checksum mismatch; staged and undo refits then leave the destinations as they were.
    """

    name = "collective"

    def __init__(self, plan: Plan, binding: Binding, process: int | None = None, src: RankTensors | None = None,
                 dst: RankTensors | None = None, *, group: "dist.ProcessGroup | Comm | None" = None,
                 in_place: bool = False, undo: bool = False, memory_cap: int = DEFAULT_MEMORY_CAP,
                 bucket_bytes: int | None = None,
                 timeout: float = 300.0, depth: int | None = None, direct_bytes: int | str | None = "auto",
                 lanes: int | None = None, on_round: Callable[[int], None] | None = None,
                 checksum: bool | str = False, delta: "DeltaPolicy | None" = None) -> None:
        if undo and in_place:
            raise ExecutionError("undo=True already writes in place (keeping the previous bytes); drop in_place")
        if lanes is not None and lanes < 1:
            raise ExecutionError(f"lanes={lanes} must be at least 1")
        if depth is not None and depth < 1:
            raise ExecutionError(f"depth={depth} must be at least 1")
        if timeout <= 0:
            raise ExecutionError(f"timeout={timeout} must be positive (seconds)")
        self.plan, self.binding, self.in_place, self.timeout = plan, binding, in_place, timeout
        self.undo = undo
        self.on_round = on_round
        self.checksum = algorithm(checksum)  # None when off
        self.comm = comm_for(group)
        self.distributed = self.comm is not None
        if self.comm is not None:
            self.rank, self.size, self.backend = self.comm.rank, self.comm.size, self.comm.backend
        else:
            self.rank, self.size, self.backend = 0, 1, "none"
        if process is not None and process != self.rank:
            raise ExecutionError(f"process={process}, but this process is rank {self.rank} of the refit group")
        binding.check(plan.src.num_ranks, plan.dst.num_ranks, self.size)
        check_ops(plan)  # before the schedule indexes anything with the plan's ops
        self._src, self._dst = dict(src or {}), dict(dst or {})
        if lanes is None:  # NCCL: each communicator runs its messages one after another (executors.collective.lanes)
            lanes = NCCL_LANES if "nccl" in self.backend else 1
        self.num_lanes = 1 if self.size == 1 else lanes
        self.depth = depth = max(2, self.num_lanes) if depth is None else depth
        if direct_bytes == "auto":  # where messages are cheap, shorter runs are worth sending unpacked
            direct_bytes = (GLOO_DIRECT_BYTES if self.backend == "gloo" else
                            LANES_DIRECT_BYTES if self.num_lanes > 1 else DIRECT_BYTES)
        self._lanes_agree = False
        self._handshake = False
        self._abort_note: str | None = None  # set by the first abort
        self.bucket_numel = bucket_numel_for(plan, binding, memory_cap, bucket_bytes, depth)
        direct_numel = 1 << 62 if direct_bytes is None else max(direct_bytes // plan.itemsize, 1)
        self.schedule: RoundSchedule = build_schedule(plan, binding, self.rank, self.bucket_numel,
                                                      not (in_place or undo), direct_numel, undo)
        self._fingerprint = _digest_int(plan.digest, binding.digest, str(self.bucket_numel), str(depth),
                                        str(direct_numel), str(undo), str(self.num_lanes), str(self.checksum))
        self._peers: list[int] = sorted({m.peer for r in self.schedule.rounds for m in r.sends + r.recvs})
        self._setup = Setup(plan, self.schedule, self.comm, self.rank, depth, timeout, in_place, undo)
        self._kept = Buffers()  # wire, staging, streams and views of the tensors of the last call
        self._given: tuple = ()  # the tensor objects of the last call that passed the checks, and their addresses
        self._version = 0
        self._num_ops = ops_landing(plan, binding.dst_ranks_of(self.rank))
        self._delta = None if delta is None else CollectiveDelta(self, delta)

    def release(self) -> None:
        """Drop the buffers and views kept between calls (wire, staging, views of the caller's tensors)."""
        self._kept = Buffers()
        self._given = ()

    @property
    def lanes(self) -> list:
        """The communicators rounds are spread over (executors.collective.lanes); the group itself first."""
        return self.comm.lanes if self.comm is not None else [None]

    # --- public ----------------------------------------------------------------------------------
    def refit(self, version: int | None = None, *, src: RankTensors | None = None,
              dst: RankTensors | None = None) -> RefitStats:
        """One refit from the tensors given at construction (or, for this call, `src` / `dst`: the plan's source /
        destination ranks this process plays -> their tensors). `version` is not needed: the preflight makes
        every process run the same refit."""
        start = time.perf_counter()
        with torch.no_grad():  # parameters may require grad; a refit is not part of any graph
            run = self._run if self._delta is None else self._delta.refit
            return run(start, dict(self._src if src is None else src), dict(self._dst if dst is None else dst),
                       version)

    @property
    def last_delta(self) -> "DeltaReport | None":
        """What this process sent in the last refit, with the `delta` option (executors.delta.DeltaReport)."""
        return None if self._delta is None else self._delta.last

    def close(self) -> None:
        self.release()

    def _run(self, start: float, src: dict, dst: dict, version: int | None) -> RefitStats:
        given, kept = _identity(src, dst), self._kept
        if kept.views is not None and given is not None and self._given and given[0] == self._given[0]:
            # the very tensor objects, at the same addresses, that passed the checks last time: skip them (they
            # are a fixed cost of every refit otherwise). Metadata changed in place (resize_, set_) is
            # not seen: pass new tensors.
            device, problem = kept.views.device, None
        else:
            self._given = ()
            prepared, problem = self._prepare(src, dst)
            device, device_problem = self._device(prepared)
            problem = problem or device_problem
        runner = None
        if problem is None:
            try:  # buffers are allocated before the preflight, so that running out of memory is reported there
                if not self._given:
                    kept.views_for(self._setup, device, prepared)
                    self._given = given or ()
                runner = make_runner(self._setup, kept)
                runner.sums = Streams(self.checksum) if self.checksum else None
            except Exception as e:  # noqa: BLE001 - becomes this process's refusal, seen by every process
                problem = f"could not prepare buffers on {device}: {type(e).__name__}: {e}"
        marks = [("prepare", time.perf_counter())]
        self._preflight(problem, device)
        marks.append(("preflight", time.perf_counter()))
        try:
            if self._handshake:  # NCCL, something not connected yet somewhere: lanes and handshake, bounded
                self._connect(device)
            elif len(self.lanes) < self.num_lanes and self._lanes_agree:
                self._make_lanes()
            self._transfer(runner)
            marks.append(("enqueue", time.perf_counter()))
            runner.drain()
            marks.append(("drain", time.perf_counter()))
            self._agree(device, self._compare_checksums(runner) if self.checksum else None)
            marks.append(("verify", time.perf_counter()))
        except ReshardError as e:
            note = self.abort() if device.type == "cuda" else ""  # gloo's waits fail on their own
            if self.undo:
                raise ExecutionError(f"{e}{note}; {runner.restore()}") from e
            if note:
                raise ExecutionError(f"{e}{note}") from e
            raise
        except Exception as e:  # a transport error: name it, keep the original as the cause
            note = self.abort() if device.type == "cuda" else ""
            restored = f"; {runner.restore()}" if self.undo else ""
            raise ExecutionError(self._setup.failure(f"{type(e).__name__}: {e}") + note + restored) from e
        runner.commit()
        marks.append(("commit", time.perf_counter()))
        s = self.schedule
        itemsize = self.plan.itemsize
        self._version = self._version + 1 if version is None else int(version)
        seconds, phases = phase_times(start, marks)
        return RefitStats(
            executor=self.name, process=self.rank, version=self._version, seconds=seconds, phases=phases,
            staged=s.staged, undo=s.undo, ops=self._num_ops, copies=runner.copies,
            bytes_sent={p: n * itemsize for p, n in s.sent.items()},
            bytes_received={p: n * itemsize for p, n in s.received.items()},
            local_bytes=s.local_numel * itemsize, staging_bytes=kept.views.staging_bytes,
            transfers=sum(len(r.sends) + len(r.recvs) for r in s.rounds), checksum=self.checksum or "",
            rounds=len(s.rounds), lanes=len(self.lanes), bucket_bytes=self.bucket_numel * itemsize,
            direct_bytes=kept.views.direct_bytes, wire_bytes=kept.views.wire_bytes)

    # --- steps -----------------------------------------------------------------------------------
    def _prepare(self, src: dict, dst: dict) -> "tuple[Prepared | None, str | None]":
        """This process's tensors checked and viewed (executors.prepared), or what is wrong with them: a refusal
        that the preflight makes every process see."""
        try:
            return Prepared(self.plan, src, dst, (self.binding.src_ranks_of(self.rank),
                                                  self.binding.dst_ranks_of(self.rank))), None
        except ExecutionError as e:
            return None, str(e)

    def _device(self, prepared: "Prepared | None") -> tuple[torch.device, str | None]:
        """The device of this process's tensors, and what is wrong with it for this group's backend."""
        fallback = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        try:
            device = (prepared.device if prepared is not None else None) or fallback
        except ExecutionError as e:
            return fallback, str(e)
        if self.backend == "nccl" and device.type != "cuda":
            return fallback, f"the NCCL group needs CUDA tensors; this process's tensors are on {device}"
        if self.backend == "gloo" and device.type != "cpu":
            return fallback, f"the gloo executor moves CPU tensors; this process's tensors are on {device}"
        return device, None

    def _preflight(self, problem: str | None, device: torch.device) -> None:
        """Everyone learns whether everyone is ready and runs the same schedule, before any byte moves."""
        if self.size == 1 or not self.distributed:
            if problem:
                raise ExecutionError(f"{problem}; nothing was moved")
            return
        fp = self._fingerprint
        comm = self.comm
        count = comm.lane_name_count() if len(self.lanes) < self.num_lanes else 0
        unconnected = device.type == "cuda" and (len(self.lanes) < self.num_lanes or not all(
            connect.ready(lane, comm.global_peer(p)) for lane in self.lanes for p in self._peers))
        t = torch.tensor([int(problem is not None), fp, -fp, count, -count, int(unconnected)], dtype=torch.int64,
                         device=device)
        self._wait_collective(lambda: comm.all_reduce_max(t), device, "preflight", before=True)
        bad, hi, lo, most, least, handshake = t.tolist()
        self._lanes_agree = most == -least and most >= 0  # every member would give a new lane the same name
        self._handshake = bool(handshake)  # any member has a pair to connect: all take part (connect)
        refuse_disagreement(problem, bad, hi == -lo, f"plan, binding and bucket size (this process: plan "
                            f"{self.plan.digest[:12]}, {self.binding}, bucket {self.bucket_numel} elements)")

    def _transfer(self, runner: RoundRunner) -> None:
        s = self.schedule
        by_stage: dict[int, list[int]] = {}
        for pos, r in enumerate(s.rounds):
            by_stage.setdefault(r.stage, []).append(pos)
        for stage in range(s.num_stages):
            if stage:
                runner.stage_barrier(stage)
            positions = by_stage.get(stage, [])
            pending: list = []
            for k, pos in enumerate(positions):
                if self.on_round is not None:
                    self.on_round(s.rounds[pos].index)
                runner.pack(pos)
                pending.append(runner.post(pos))
                runner.local(stage, k)  # local copies spread over the stage's rounds
                while len(pending) >= self.depth:
                    runner.complete(pending.pop(0))
            if not positions:
                runner.local(stage, 0)
            while pending:
                runner.complete(pending.pop(0))

    def _compare_checksums(self, runner: RoundRunner) -> str | None:
        """Send every peer this process sent bytes to the SHA-256 of those bytes, receive the same from every peer
        it received from, and compare with what arrived (executors.checksum). Returns the mismatch, if any."""
        s, comm, sums = self.schedule, self.comm, runner.sums
        if comm is None or self.size == 1:
            return None
        device = runner.b.device
        if device.type == "cuda":  # the sums ran on the runner's streams; the digests are read on this one
            torch.cuda.synchronize(device)
        # the digests travel as the group's tensors do: on the device (NCCL takes GPU tensors only)
        out = {p: torch.tensor(list(sums.digest(("to", p))), dtype=torch.uint8, device=device)
               for p in sorted(s.sent)}
        got = {p: torch.zeros(DIGEST_BYTES, dtype=torch.uint8, device=device) for p in sorted(s.received)}
        works = comm.post(comm.prepare(0, [(t, p, CHECKSUM_TAG) for p, t in out.items()],
                                       [(t, p, CHECKSUM_TAG) for p, t in got.items()]))
        try:
            for w in works:
                w.wait(timedelta(seconds=self.timeout))
        except RuntimeError as e:  # gloo's timeout or a peer's closed socket
            raise ExecutionError(self._setup.failure(f"the checksum exchange with peers did not complete: "
                                                     f"{str(e).splitlines()[0] if str(e) else type(e).__name__}")) \
                from e
        bad = [mismatch(f"the stream from group rank {p}", bytes(t.tolist()).hex(), sums.hexdigest(("from", p)))
               for p, t in got.items() if bytes(t.tolist()) != sums.digest(("from", p))]
        return "; ".join(bad) or None

    def _agree(self, device: torch.device, problem: str | None = None) -> None:
        """Verify: every process finished its transfer (and, with checksums, found no corrupted byte). Only then
        does anyone commit."""
        if self.size == 1 or not self.distributed:
            if problem:
                raise ExecutionError(self._setup.failure(problem))
            return
        t = torch.full((1,), int(problem is not None), dtype=torch.int64, device=device)
        self._wait_collective(lambda: self.comm.all_reduce_max(t), device, "verify")
        if problem:
            raise ExecutionError(self._setup.failure(problem))
        if int(t.item()):
            raise ExecutionError(self._setup.failure("another process reported an incomplete transfer or bytes "
                                                     "corrupted in flight"))

    def _make_lanes(self) -> None:
        # every member passed the preflight and agrees on the names: all make them together
        if self._lanes_agree:
            self.comm.make_lanes(self.num_lanes, self.timeout)

    def _connect(self, device: torch.device) -> None:
        """Make the lanes and connect every peer on every lane, off this thread and bounded (executors.collective.connect)."""
        comm, peers = self.comm, self._peers

        def make() -> list:
            self._make_lanes()
            return connect.handshake(comm, peers, device)

        try:
            works = connect.off_thread(make, self.timeout, device, "making lanes and connecting to peers")
            for w in works:
                w.wait()
            ev = torch.cuda.Event()
            ev.record()
            wait_events([ev], self.timeout, ["the handshake with peers"])
        except ExecutionError as e:
            raise ExecutionError(self._setup.failure(str(e), before=True)) from e
        connect.mark_ready(self.lanes, [comm.global_peer(p) for p in peers])

    def _wait_collective(self, start: Callable, device: torch.device, what: str, before: bool = False) -> None:
        try:
            if device.type == "cuda" and not connect.ready(self.lanes[0]):  # NCCL connects at the first collective
                work = connect.off_thread(start, self.timeout, device, f"the first {what} all-reduce of the group")
            else:
                work = start()
            if device.type == "cuda":
                work.wait()
                ev = torch.cuda.Event()
                ev.record()
                wait_events([ev], self.timeout, [f"{what} all-reduce"])
                connect.mark_ready(self.lanes[:1], [-1])
            else:
                work.wait(timedelta(seconds=self.timeout))
        except Exception as e:
            note = self.abort() if device.type == "cuda" else ""
            raise ExecutionError(self._setup.failure(f"{what} all-reduce did not complete: {e}", before) + note) from e

    def abort(self) -> str:
        """Unblock the transport after a failure: abort the group and its lanes, all at once (runners.abort),
        waiting at most `timeout`. All are unusable afterwards. Returns a note for the error message, empty
        when every abort finished."""
        if self._abort_note is None:
            stuck = abort(list(self.lanes), self.timeout)
            self._abort_note = "" if not stuck else (
                f"; aborting {len(stuck)} of the {len(self.lanes)} communicators (lanes) did not finish within "
                f"{self.timeout:.1f} s: restart this process")
            connect.forget(self.lanes)
            if self.comm is not None:
                self.comm.forget_lanes()
        return self._abort_note



def _identity(src: dict, dst: dict) -> tuple | None:
    """(ranks, ids and addresses of the given tensors; the tensors, kept so that their ids stay unique)."""
    try:
        ts = [t for side in (src, dst) for r in sorted(side) for t in side[r].values()]
        key = (tuple(sorted(src)), tuple(sorted(dst)), *map(id, ts), *(t.data_ptr() for t in ts))
    except (AttributeError, TypeError):  # not tensors: the full checks say what is wrong
        return None
    return key, ts


def execute_collective(plan: Plan, binding: Binding, src: RankTensors | None, dst: RankTensors | None,
                        group: dist.ProcessGroup | None = None, **options) -> RefitStats:
    """One refit with a fresh executor (build a `CollectiveExecutor` to reuse schedule and buffers).

    Args:
        plan: the plan.
        binding: which group rank plays each plan rank.
        src: this process's source tensors (rank -> name -> tensor).
        dst: this process's destination tensors.
        group: the refit group (default: the whole world).
        **options: `CollectiveExecutor` options.

    Returns:
        This process's stats.

    Raises:
        ExecutionError: as `CollectiveExecutor.refit`.
    """
    return CollectiveExecutor(plan, binding, None, src, dst, group=group, **options).refit()
