"""Run a plan across real processes over torch.distributed: NCCL between GPUs, gloo between CPU processes.

Every process of the refit group builds the executor with the same plan and binding and its own tensors, then
calls `refit` at every weight update. A refit: (1) checks this process's tensors and views the schedule over them
(runners.RoundViews, kept while the same tensors come back); (2) preflight: one all-reduce, and every process
raises before a byte moves if any is not ready or runs another plan, binding or bucket size (on NCCL the first
refit then makes the lanes and connects every pair, bounded: connect.py); (3) transfer, stage by stage: per round,
pack, post the round's sends and receives as one batch, later wait and scatter, local copies spread over the
rounds (on GPUs on streams of their own); (4) verify: one all-reduce says whether every process completed (with
`checksum`: intact); (5) commit the staged regions into the destination tensors and return `RefitStats`.

Deadlock freedom: every process derives the same global rounds (schedule.py), each message belongs to one round,
and a process posts its rounds in increasing order, all of one round's operations at once (`batch_isend_irecv`;
on NCCL one group call); by induction on the round, every operation finds its match. Round r travels on lane
r mod lanes (lanes.py), which both ends derive from the global index; relays only add local waits.

Staging (default): destination tensors that receive from a peer (or that this process relays from) get a shadow
that takes the writes, copied in only after every process verified, so a failed refit changes nothing, for that
memory once more (`release()` frees it). `in_place=True` writes straight in (a failure leaves them partly written);
`undo=True` writes in place after backing each region up into its shadow, and puts the backups back on failure.
Wire buffers: `depth` rounds in flight x the most peers in one round x the bucket, kept under `memory_cap`.

Failure: a dead or frozen peer makes every survivor raise ExecutionError within `timeout` of it starting to wait
(gloo waits carry the timeout; on GPUs the host polls CUDA events, then aborts every lane at once: runners.abort);
a process not talking to the failed one fails at the verify. Afterwards destroy and rebuild the process group.
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
from ..base import Executor, RankTensors, RefitStats, phase_times
from ..binding import Binding
from ..checksum import DIGEST_BYTES, algorithm, mismatch
from .comm import Comm, comm_for
from ...polling import wait_events
from .runners import Buffers, CudaRunner, HostRunner, RoundRunner, abort
from ..preflight import check_ops, refuse_disagreement
from .lanes import NCCL_LANES
from ..partition import Prepared
from ..delta import DeltaPolicy
from .delta import CollectiveDelta
from .schedule import (DIRECT_BYTES, GLOO_DIRECT_BYTES, LANES_DIRECT_BYTES, RoundSchedule, bucket_numel_for,
                       build_schedule)

DEFAULT_MEMORY_CAP = 2 << 30
CHECKSUM_TAG = (1 << 30) - 1  # the checksum exchange's messages; schedule tags are message numbers below it


class CollectiveExecutor(Executor):
    """Runs one plan repeatedly on this process's part of a binding over torch.distributed (gloo, NCCL).

    Args:
        plan: the plan.
        binding: which group rank plays each plan rank.
        process: this process's rank in the refit group (None: read from the group).
        src: the tensors of the source ranks this process plays (rank -> name -> tensor).
        dst: the tensors of the destination ranks this process plays; `refit(src=..., dst=...)` may pass others.
        group: the refit group, every member of which calls `refit`: a group of this process's world (default:
            the whole world) or a `comm.StoreComm`.
        in_place: write straight into the destination tensors. Default False: staged (module docstring).
        undo: write in place, backing each region up first and putting it back if the refit fails.
        memory_cap: bytes of wire buffers per process (`depth` rounds in flight x peers per round x bucket).
        bucket_bytes: the largest message; default as large as `memory_cap` allows.
        timeout: seconds any wait may go without progress before the refit fails with ExecutionError.
        depth: rounds in flight per process; default max(2, lanes).
        direct_bytes: runs at least this long that are contiguous in one side's memory travel unpacked (None:
            only whole contiguous messages). "auto": NCCL 64 MiB on one lane, 16 MiB on several; gloo 64 KiB.
        lanes: communicators the rounds are spread over (lanes.py). Default: 3 on NCCL, 1 otherwise.
        on_round: called with each round's index before it is posted (progress reporting, fault injection).
        checksum: hash the bytes sent to and received from every peer (True or "sha256", or "sum64", which
            NCCL computes on the GPU: executors.checksum) and fail the refit everywhere on a mismatch.
        delta: a `DeltaPolicy` (executors.delta): refits move only the changed elements (delta.py); None:
            every refit dense.

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
        for name, value in (("lanes", lanes), ("depth", depth)):
            if value is not None and value < 1:
                raise ExecutionError(f"{name}={value} must be at least 1")
        if timeout <= 0:
            raise ExecutionError(f"timeout={timeout} must be positive (seconds)")
        self.plan, self.binding, self.in_place, self.undo, self.timeout = plan, binding, in_place, undo, timeout
        self.on_round = on_round
        self.checksum = algorithm(checksum)  # None when off
        self.comm = comm_for(group)
        self.rank, self.size, self.backend = ((self.comm.rank, self.comm.size, self.comm.backend)
                                              if self.comm is not None else (0, 1, "none"))
        if process is not None and process != self.rank:
            raise ExecutionError(f"process={process}, but this process is rank {self.rank} of the refit group")
        binding.check(plan.src.num_ranks, plan.dst.num_ranks, self.size)
        check_ops(plan)  # before the schedule indexes anything with the plan's ops
        self._src, self._dst = dict(src or {}), dict(dst or {})
        if lanes is None:
            lanes = NCCL_LANES if "nccl" in self.backend else 1
        self.num_lanes = 1 if self.size == 1 else lanes
        self.depth = depth = max(2, self.num_lanes) if depth is None else depth
        if direct_bytes == "auto":
            direct_bytes = (GLOO_DIRECT_BYTES if self.backend == "gloo" else
                            LANES_DIRECT_BYTES if self.num_lanes > 1 else DIRECT_BYTES)
        self._lanes_agree = self._handshake = False  # set by each preflight
        self._abort_note: str | None = None  # set by the first abort
        self.bucket_numel = bucket_numel_for(plan, binding, memory_cap, bucket_bytes, depth)
        direct_numel = 1 << 62 if direct_bytes is None else max(direct_bytes // plan.itemsize, 1)
        self.schedule: RoundSchedule = build_schedule(plan, binding, self.rank, self.bucket_numel,
                                                      not (in_place or undo), direct_numel, undo)
        self._fingerprint = int(hashlib.sha256("|".join(map(str, (
            plan.digest, binding.digest, self.bucket_numel, depth, direct_numel, undo, self.num_lanes,
            self.checksum))).encode()).hexdigest()[:15], 16)
        self._peers: list[int] = sorted({m.peer for r in self.schedule.rounds for m in r.sends + r.recvs})
        self._kept = Buffers()  # wire, staging, streams and views of the tensors of the last call
        self._version = 0
        self._delta = None if delta is None else CollectiveDelta(self, delta)

    def release(self) -> None:
        """Drop the buffers and views kept between calls (wire, staging, views of the caller's tensors); `close`
        does the same (the group stays the caller's)."""
        self._kept = Buffers()

    close = release

    def _failure(self, what: str, before: bool = False) -> str:
        """The message of a refit that failed because of `what` (`before`: before any byte moved)."""
        state = ("nothing was moved" if before else
                 "destination tensors were written in place; their previous bytes are put back" if self.undo else
                 "destination tensors were left unchanged (staged refit)" if not self.in_place else
                 "destination tensors may be partly written (in_place=True)")
        return (f"refit failed on group rank {self.rank} (plan {self.plan.digest[:12]}): {what}; {state}; the "
                f"process group is no longer usable: destroy and rebuild it")

    @property
    def lanes(self) -> list:
        """The communicators rounds are spread over (lanes.py); the group itself first."""
        return self.comm.lanes if self.comm is not None else [None]

    def refit(self, version: int | None = None, *, src: RankTensors | None = None,
              dst: RankTensors | None = None) -> RefitStats:
        """One refit from the tensors given at construction, or for this call `src` / `dst` (rank -> name ->
        tensor). `version` is optional: the preflight makes every process run the same refit."""
        start = time.perf_counter()
        with torch.no_grad():  # parameters may require grad; a refit is not part of any graph
            run = self._run if self._delta is None else self._delta.refit
            return run(start, dict(self._src if src is None else src), dict(self._dst if dst is None else dst),
                       version)

    def _run(self, start: float, src: dict, dst: dict, version: int | None) -> RefitStats:
        given, kept = _identity(src, dst), self._kept
        if given is not None and kept.given and given[0] == kept.given[0]:
            # the very tensor objects, at the same addresses, that passed the checks last time: skip the checks
            # (metadata changed in place by resize_ or set_ is not seen: pass new tensors)
            device, problem = kept.views.device, None
        else:
            kept.given = ()
            prepared, device, problem = self._prepare(src, dst)
        runner = None
        if problem is None:
            try:  # buffers are allocated before the preflight, so that running out of memory is reported there
                if not kept.given:
                    kept.views_for(self, device, prepared)
                    kept.given = given or ()
                runner = (CudaRunner if kept.views.device.type == "cuda" else HostRunner)(self, kept)
            except Exception as e:  # noqa: BLE001 - becomes this process's refusal, seen by every process
                problem = f"could not prepare buffers on {device}: {type(e).__name__}: {e}"
        marks = [("prepare", time.perf_counter())]
        self._preflight(problem, device)
        marks.append(("preflight", time.perf_counter()))
        try:
            if self._handshake:  # NCCL, something not connected yet somewhere: lanes and handshake, bounded
                self._connect(device)
            elif len(self.lanes) < self.num_lanes:
                self._make_lanes()
            self._transfer(runner)
            marks.append(("enqueue", time.perf_counter()))
            runner.drain()
            marks.append(("drain", time.perf_counter()))
            self._agree(device, self._compare_checksums(runner) if self.checksum else None)
            marks.append(("verify", time.perf_counter()))
        except Exception as e:
            note = self.abort() if device.type == "cuda" else ""  # gloo's waits fail on their own
            note += f"; {runner.restore()}" if self.undo else ""
            if not isinstance(e, ReshardError):  # a transport error: name it, keep the original as the cause
                raise ExecutionError(self._failure(f"{type(e).__name__}: {e}") + note) from e
            if note:
                raise ExecutionError(f"{e}{note}") from e
            raise
        runner.commit()
        marks.append(("commit", time.perf_counter()))
        s, itemsize = self.schedule, self.plan.itemsize
        self._version = self._version + 1 if version is None else int(version)
        seconds, phases = phase_times(start, marks)
        return RefitStats(
            executor=self.name, process=self.rank, version=self._version, seconds=seconds, phases=phases,
            staged=s.staged, undo=s.undo, ops=len(s.part.landing), copies=runner.copies,
            bytes_sent=dict(s.part.bytes_sent), bytes_received=dict(s.part.bytes_received),
            local_bytes=s.part.local_numel * itemsize, staging_bytes=kept.views.staging_bytes,
            transfers=sum(len(r.sends) + len(r.recvs) for r in s.rounds), checksum=self.checksum or "",
            rounds=len(s.rounds), lanes=len(self.lanes), bucket_bytes=self.bucket_numel * itemsize,
            direct_bytes=kept.views.direct_bytes, wire_bytes=kept.views.wire_bytes)

    def _prepare(self, src: dict, dst: dict) -> "tuple[Prepared | None, torch.device, str | None]":
        """This process's tensors checked (executors.partition), their device, and what is wrong with either (a
        refusal for the preflight)."""
        fallback = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        try:
            prepared = Prepared(self.plan, src, dst, self.binding, self.rank)
            device = prepared.device or fallback
        except ExecutionError as e:
            return None, fallback, str(e)
        if self.backend == "nccl" and device.type != "cuda":
            return prepared, fallback, f"the NCCL group needs CUDA tensors; this process's tensors are on {device}"
        if self.backend == "gloo" and device.type != "cpu":
            return prepared, fallback, f"the gloo executor moves CPU tensors; this process's tensors are on {device}"
        return prepared, device, None

    def _preflight(self, problem: str | None, device: torch.device) -> None:
        """Everyone learns whether everyone is ready and runs the same schedule, before any byte moves."""
        fp, comm = self._fingerprint, self.comm
        count = comm.lane_name_count() if len(self.lanes) < self.num_lanes else 0
        unconnected = device.type == "cuda" and (len(self.lanes) < self.num_lanes or not all(
            connect.ready(lane, comm.global_peer(p)) for lane in self.lanes for p in self._peers))
        bad, hi, lo, most, least, handshake = self._vote(
            [int(problem is not None), fp, -fp, count, -count, int(unconnected)], device, "preflight", before=True)
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
        """Exchange with every peer the digests of the bytes sent and received (executors.checksum) and compare
        them with this process's. Returns the mismatch, if any."""
        s, sums = self.schedule, runner.sums
        if self.size == 1:
            return None
        device = runner.b.device
        if device.type == "cuda":  # the sums ran on the runner's streams; the digests are read on this one
            torch.cuda.synchronize(device)
        # the digests travel on the device (NCCL takes GPU tensors only)
        out = {p: torch.tensor(list(sums.digest(("to", p))), dtype=torch.uint8, device=device)
               for p in sorted(s.part.sends_to)}
        got = {p: torch.zeros(DIGEST_BYTES, dtype=torch.uint8, device=device) for p in sorted(s.part.receives_from)}
        self._exchange([(t, p, CHECKSUM_TAG) for p, t in out.items()], [(t, p, CHECKSUM_TAG) for p, t in got.items()],
                       "the checksum exchange with peers did not complete")
        bad = [mismatch(f"the stream from group rank {p}", bytes(t.tolist()).hex(), sums.hexdigest(("from", p)))
               for p, t in got.items() if bytes(t.tolist()) != sums.digest(("from", p))]
        return "; ".join(bad) or None

    def _exchange(self, sends: list, recvs: list, what: str) -> None:
        """Post one batch of (tensor, peer, tag) messages on the group and wait for it, bounded by the timeout."""
        try:
            for w in self.comm.post(self.comm.prepare(0, sends, recvs)):
                w.wait(timedelta(seconds=self.timeout))
        except RuntimeError as e:  # gloo's timeout or a peer's closed socket
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ExecutionError(self._failure(f"{what}: {first}")) from e

    def _agree(self, device: torch.device, problem: str | None = None) -> None:
        """Verify: every process finished its transfer (with checksums: intact). Only then does anyone commit."""
        (bad,) = self._vote([int(problem is not None)], device, "verify")
        if problem:
            raise ExecutionError(self._failure(problem))
        if bad:
            raise ExecutionError(self._failure("another process reported an incomplete transfer or bytes "
                                               "corrupted in flight"))

    def _make_lanes(self) -> None:
        if self._lanes_agree:  # every member passed the preflight and agrees on the names: all make them together
            self.comm.make_lanes(self.num_lanes, self.timeout)

    def _connect(self, device: torch.device) -> None:
        """Make the lanes and connect every peer on every lane, off this thread and bounded (connect.py)."""
        comm, peers = self.comm, self._peers

        def make() -> list:
            self._make_lanes()
            return connect.handshake(comm, peers, device)

        try:
            works = connect.off_thread(make, self.timeout, device, "making lanes and connecting to peers")
            self._wait_gpu(works, "the handshake with peers")
        except ExecutionError as e:
            raise ExecutionError(self._failure(str(e), before=True)) from e
        connect.mark_ready(self.lanes, [comm.global_peer(p) for p in peers])

    def _vote(self, values: list[int], device: torch.device, what: str, before: bool = False) -> list[int]:
        """The element-wise MAX of every member's `values` (one all-reduce, bounded by the timeout; one process:
        its own). A vote that does not complete fails the refit (`before`: before any byte moved)."""
        if self.size == 1:
            return values
        t = torch.tensor(values, dtype=torch.int64, device=device)

        def start():
            return self.comm.all_reduce_max(t)

        try:
            if device.type == "cuda" and not connect.ready(self.lanes[0]):  # NCCL connects at the first collective
                work = connect.off_thread(start, self.timeout, device, f"the first {what} all-reduce of the group")
            else:
                work = start()
            if device.type == "cuda":
                self._wait_gpu([work], f"{what} all-reduce")
                connect.mark_ready(self.lanes[:1], [-1])
            else:
                work.wait(timedelta(seconds=self.timeout))
        except Exception as e:
            note = self.abort() if device.type == "cuda" else ""
            raise ExecutionError(self._failure(f"{what} all-reduce did not complete: {e}", before) + note) from e
        return t.tolist()

    def _wait_gpu(self, works: list, what: str) -> None:
        """Order the current stream after `works`, then wait for it on the host, bounded by the timeout."""
        for w in works:
            w.wait()
        ev = torch.cuda.Event()
        ev.record()
        wait_events([ev], self.timeout, [what])

    def abort(self) -> str:
        """Abort the group and its lanes after a failure, all at once (runners.abort), waiting at most `timeout`;
        all are unusable afterwards. Returns a note for the error message, empty when every abort finished."""
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
