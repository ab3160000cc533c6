"""Run a plan across real processes over torch.distributed: NCCL between GPUs, gloo between CPU processes.

Every process of the refit group calls `run` with the same plan and binding and its own tensors; it sends what
it owns and receives what it needs. Lifecycle of `DistributedExecutor(plan, binding, group).run(src, dst)`:

  1. construction: the binding is checked against the plan and the group; this process's part of the wire
     schedule is built (executors.schedule: streams per peer, buckets, rounds, folded copy programs). Build
     the executor once and call `run` at every refit: the schedule and the wire buffers are reused;
  2. preflight: this process checks its tensors against the plan (names, shapes, dtype, contiguity, device),
     then one small all-reduce tells every process whether all are ready and run the same plan, binding and
     bucket size; on any mismatch every process raises before a byte moves;
  3. transfer, stage by stage: for each round, pack the round's sends into wire buffers, post the round's
     sends and receives as one batch, and (one round later) wait for them and scatter what arrived; local
     copies (bytes between ranks played by one process) run beside; relays of stage s+1 start after this
     process has finished stage s;
  4. verify: every message of this process completed, with the byte count the schedule expects; then one
     all-reduce says whether every process got there;
  5. commit (staged, the default): copy the staged regions into the destination tensors and run the local
     copies kept for commit; then return `ExecutionStats`.

Deadlock freedom. Rounds are numbered globally (schedule.py): every process derives the same rounds from the
same plan, binding and bucket size, and each message belongs to exactly one round, in which its sender posts
the send and its receiver the receive. A process posts its rounds in increasing order, and all of one round's
sends and receives at once (`batch_isend_irecv`, non-blocking; on NCCL one group call that progresses every
pair together, so no cycle of blocking sends can form within a round). Induction on the round index: when
every process has finished its rounds before r, every process taking part in round r has posted all of round
r's operations (posting never waits on another process; with two rounds in flight, posting r only waits for
this process's own round r-2), so every operation of round r finds its match and completes. Between one
pair, messages are matched in posting order (NCCL) or by tag = round (gloo), and both sides post a pair's
messages in the same round order. Relays add only local waits (a process finishes stage s before packing
stage s+1), so the induction still holds.

Staging and its memory cost. By default a destination tensor that receives any bytes from another process
(or that this process forwards from, in fan-out trees) gets a shadow: a staging tensor of the same size
into which everything destined for it is written while the refit is in flight. Only after every process
reported a complete transfer (step 4) are the shadows copied into the destination tensors. A failed refit
therefore leaves every destination tensor unchanged. Extra memory: the shadowed destination tensors once
more (at most this process's whole destination share, e.g. 16.4 GB for a TP1 Qwen3-8B replica), plus an extra
copy of those bytes at commit. Destination tensors fed only by local copies need no shadow: their copies
run at commit, straight from the source. `in_place=True` writes straight into the destination tensors and
keeps no shadow; a failed refit then leaves them partly written.

Wire buffers: `depth` (2) rounds in flight x the most peers a process has in one round x the bucket size; the
bucket is chosen so that this stays under `memory_cap` on the busiest process.

Failure. A dead or hanging peer makes every surviving process raise ExecutionError within `timeout` seconds
of it starting to wait: gloo waits carry the timeout; on GPUs the host polls CUDA events of each round and
gives up after `timeout` seconds without progress, then aborts the communicator. A process that does not talk
to the failed one directly fails in the verify all-reduce. After a failure the process group is not usable:
destroy and rebuild it.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from ..errors import ExecutionError, ReshardError
from ..planner import Plan
from .binding import Binding
from .copies import DST, KIND_NAMES, SHADOW, SRC, WIRE, run_copies
from .local import check_tensors, torch_dtype
from .schedule import ProcessSchedule, Round, bucket_numel_for, build_schedule

RankTensors = Mapping[int, Mapping[str, torch.Tensor]]
DEFAULT_MEMORY_CAP = 2 << 30


@dataclass(frozen=True)
class ExecutionStats:
    """What one process did in one refit."""

    process: int
    staged: bool
    seconds: float  # wall clock, preflight to commit
    transfer_seconds: float  # preflight end to every message of this process done
    commit_seconds: float
    bytes_sent: dict[int, int] = field(default_factory=dict)  # peer (group rank) -> bytes
    bytes_received: dict[int, int] = field(default_factory=dict)
    local_bytes: int = 0
    rounds: int = 0
    messages: int = 0
    copies: int = 0  # block copies launched (pack, scatter, local, commit)
    bucket_bytes: int = 0
    wire_buffer_bytes: int = 0
    staging_bytes: int = 0


def _digest_int(*parts: str) -> int:
    return int(hashlib.sha256("|".join(parts).encode()).hexdigest()[:15], 16)


class DistributedExecutor:
    """Runs one plan repeatedly on this process's part of a binding. See the module docstring."""

    def __init__(self, plan: Plan, binding: Binding, group: dist.ProcessGroup | None = None, *,
                 in_place: bool = False, memory_cap: int = DEFAULT_MEMORY_CAP, bucket_bytes: int | None = None,
                 timeout: float = 300.0, depth: int = 2,
                 on_round: Callable[[int], None] | None = None) -> None:
        if depth < 1:
            raise ExecutionError(f"depth={depth} must be at least 1")
        if timeout <= 0:
            raise ExecutionError(f"timeout={timeout} must be positive (seconds)")
        self.plan, self.binding, self.in_place, self.timeout, self.depth = plan, binding, in_place, timeout, depth
        self.on_round = on_round
        self.distributed = dist.is_available() and dist.is_initialized()
        if self.distributed:
            self.group = group if group is not None else dist.group.WORLD
            self.rank = dist.get_rank(self.group)
            if self.rank < 0:
                raise ExecutionError("this process is not a member of the refit group; only members call the executor")
            self.size = dist.get_world_size(self.group)
            self.backend = str(dist.get_backend(self.group)).lower()
        else:
            if group is not None:
                raise ExecutionError("a process group was given but torch.distributed is not initialized")
            self.group, self.rank, self.size, self.backend = None, 0, 1, "none"
        binding.check(plan.src.num_ranks, plan.dst.num_ranks, self.size)
        self.bucket_numel = bucket_numel_for(plan, binding, memory_cap, bucket_bytes, depth)
        self.schedule: ProcessSchedule = build_schedule(plan, binding, self.rank, self.bucket_numel, not in_place)
        self._fingerprint = _digest_int(plan.digest, binding.digest, str(self.bucket_numel), str(depth))
        self._global = {}
        if self.distributed:
            peers = {m.peer for r in self.schedule.rounds for m in r.sends + r.recvs}
            self._global = {p: self._global_rank(p) for p in peers}
        self._programs = None
        self._wire: torch.Tensor | None = None

    def _global_rank(self, group_rank: int) -> int:
        if self.group is None or self.group is dist.group.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    # --- public ----------------------------------------------------------------------------------
    def run(self, src: RankTensors | None, dst: RankTensors | None) -> ExecutionStats:
        """Refit: `src` / `dst` map the plan's source / destination ranks this process plays to their tensors."""
        start = time.perf_counter()
        src, dst = dict(src or {}), dict(dst or {})
        problem = self._check_local(src, dst)
        device, device_problem = self._device(src, dst)
        problem = problem or device_problem
        engine = None
        if problem is None:
            try:  # buffers are allocated before the preflight, so that running out of memory is reported there
                engine = (_CudaEngine if device.type == "cuda" else _HostEngine)(self, device, src, dst)
            except Exception as e:  # noqa: BLE001 - becomes this process's refusal, seen by every process
                problem = f"could not prepare buffers on {device}: {type(e).__name__}: {e}"
        self._preflight(problem, device)
        try:
            self._transfer(engine)
            engine.drain()
            transfer_end = time.perf_counter()
            self._agree(engine, device)
        except ReshardError:
            engine.abort()
            raise
        except Exception as e:  # a transport error: name it, keep the original as the cause
            engine.abort()
            raise ExecutionError(self._failure(f"{type(e).__name__}: {e}")) from e
        engine.commit()
        end = time.perf_counter()
        s = self.schedule
        itemsize = self.plan.itemsize
        return ExecutionStats(
            process=self.rank, staged=s.staged, seconds=end - start, transfer_seconds=transfer_end - start,
            commit_seconds=end - transfer_end,
            bytes_sent={p: n * itemsize for p, n in s.sent.items()},
            bytes_received={p: n * itemsize for p, n in s.received.items()},
            local_bytes=s.local_numel * itemsize, rounds=len(s.rounds),
            messages=sum(len(r.sends) + len(r.recvs) for r in s.rounds), copies=engine.copies,
            bucket_bytes=self.bucket_numel * itemsize, wire_buffer_bytes=engine.wire_bytes,
            staging_bytes=engine.staging_bytes)

    # --- steps -----------------------------------------------------------------------------------
    def _check_local(self, src: dict, dst: dict) -> str | None:
        want_src = set(self.binding.src_ranks_of(self.rank))
        want_dst = set(self.binding.dst_ranks_of(self.rank))
        problems = []
        for side, got, want in (("source", src, want_src), ("destination", dst, want_dst)):
            if set(got) != want:
                problems.append(f"{side} ranks given {sorted(got)}, but the binding has this process "
                                f"(group rank {self.rank}) play {sorted(want)}")
        if problems:
            return "; ".join(problems)
        try:
            check_tensors(self.plan, src, dst)
        except ExecutionError as e:
            return str(e)
        return None

    def _device(self, src: dict, dst: dict) -> tuple[torch.device, str | None]:
        """The device of this process's tensors, and what is wrong with it for this group's backend."""
        fallback = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        devices = {t.device for side in (src, dst) for ts in side.values() for t in ts.values()
                   if isinstance(t, torch.Tensor)}
        if len(devices) > 1:
            return fallback, f"this process's tensors are on several devices {sorted(map(str, devices))}"
        device = devices.pop() if devices else fallback
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
        t = torch.tensor([int(problem is not None), fp, -fp], dtype=torch.int64, device=device)
        self._wait_collective(lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True),
                              device, "preflight", before=True)
        bad, hi, lo = t.tolist()
        if problem:
            raise ExecutionError(f"{problem}; nothing was moved")
        if bad:
            raise ExecutionError("another process of the refit group refused its tensors (its own error says "
                                 "why); nothing was moved")
        if hi != -lo:
            raise ExecutionError("the processes of the refit group do not run the same plan, binding and bucket "
                                 f"size (this process: plan {self.plan.digest[:12]}, {self.binding}, bucket "
                                 f"{self.bucket_numel} elements); nothing was moved")

    def _transfer(self, engine: "_Engine") -> None:
        s = self.schedule
        by_stage: dict[int, list[Round]] = {}
        for r in s.rounds:
            by_stage.setdefault(r.stage, []).append(r)
        n = 0
        for stage in range(s.num_stages):
            if stage:
                engine.stage_barrier(stage)
            pending: list = []
            local_started = False
            for rnd in by_stage.get(stage, []):
                if self.on_round is not None:
                    self.on_round(rnd.index)
                slot = n % self.depth
                n += 1
                engine.pack(rnd, slot)
                pending.append(engine.post(rnd, slot))
                if not local_started:  # local copies overlap the first round of the stage
                    engine.local(stage)
                    local_started = True
                while len(pending) >= self.depth:
                    engine.complete(pending.pop(0))
            if not local_started:
                engine.local(stage)
            while pending:
                engine.complete(pending.pop(0))

    def _agree(self, engine: "_Engine", device: torch.device) -> None:
        """Verify: every process finished its transfer. Only then does anyone commit."""
        if self.size == 1 or not self.distributed:
            return
        t = torch.zeros(1, dtype=torch.int64, device=device)
        self._wait_collective(lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True),
                              device, "verify")
        if int(t.item()):
            raise ExecutionError(self._failure("another process reported an incomplete transfer"))

    def _wait_collective(self, start: Callable, device: torch.device, what: str, before: bool = False) -> None:
        try:
            work = start()
            if device.type == "cuda":
                work.wait()
                ev = torch.cuda.Event()
                ev.record()
                _poll([ev], self.timeout, lambda: f"{what} all-reduce")
            else:
                work.wait(timedelta(seconds=self.timeout))
        except Exception as e:
            if device.type == "cuda":
                _abort(self.group)
            raise ExecutionError(self._failure(f"{what} all-reduce did not complete: {e}", before)) from e

    def _failure(self, what: str, before: bool = False) -> str:
        state = ("nothing was moved" if before else
                 "destination tensors were left unchanged (staged refit)" if not self.in_place else
                 "destination tensors may be partly written (in_place=True)")
        return (f"refit failed on group rank {self.rank} (plan {self.plan.digest[:12]}): {what}; {state}; the "
                f"process group is no longer usable: destroy and rebuild it")


def _abort(group) -> None:
    """Unblock NCCL kernels that wait for a dead peer (best effort: the error being raised says what failed)."""
    try:
        from torch.distributed.distributed_c10d import _abort_process_group
        _abort_process_group(group)
    except Exception:  # noqa: BLE001
        pass


def _poll(events: list, timeout: float, name: Callable[[], str], what: list[str] | None = None) -> None:
    """Wait for CUDA events in order; fail after `timeout` seconds without one of them completing."""
    last = time.monotonic()
    for i, ev in enumerate(events):
        while not ev.query():
            if time.monotonic() - last > timeout:
                where = what[i] if what else name()
                raise ExecutionError(f"no progress for {timeout:.1f} s waiting for {where}")
            time.sleep(0.0002)
        last = time.monotonic()


class _Engine:
    """Moves one process's part of a schedule: packing, posting, completing rounds, local copies, commit."""

    def __init__(self, ex: DistributedExecutor, device: torch.device, src: dict, dst: dict) -> None:
        self.ex, self.device, s = ex, device, ex.schedule
        plan = ex.plan
        self.copies = 0
        self.src_flat: dict[int, torch.Tensor] = {}
        self.dst_flat: dict[int, torch.Tensor] = {}
        for i in s.src_ids:
            self.src_flat[i] = src[plan.src_tensors.ranks[i]][plan.src_tensors.names[i]].view(-1)
        for i in s.dst_ids:
            self.dst_flat[i] = dst[plan.dst_tensors.ranks[i]][plan.dst_tensors.names[i]].view(-1)
        dtype = torch_dtype(plan.dst.dtype)
        self.shadow = {i: torch.empty_like(self.dst_flat[i]) for i in s.shadow}
        self.staging_bytes = sum(t.numel() for t in self.shadow.values()) * plan.itemsize
        need = ex.depth * s.buffers_per_round * s.bucket_numel
        if ex._wire is None or ex._wire.numel() < need or ex._wire.device != device:
            ex._wire = torch.empty(need, dtype=dtype, device=device)
        self.wire = ex._wire[:need].view(ex.depth, max(s.buffers_per_round, 1) if need else 0, s.bucket_numel) \
            if need else ex._wire[:0]
        self.wire_bytes = need * plan.itemsize
        self.memory_tables = {SRC: self.src_flat, DST: self.dst_flat, SHADOW: self.shadow}
        if ex._programs is None:  # folded programs as plain tuples, once per executor
            ex._programs = {
                "rounds": [([m.copies.rows_as_lists() for m in r.sends], [m.copies.rows_as_lists() for m in r.recvs])
                           for r in s.rounds],
                "local": [c.rows_as_lists() for c in s.local],
                "deferred": s.deferred.rows_as_lists(), "commit": s.commit.rows_as_lists(),
            }
        self.programs = ex._programs
        self.round_pos = {r.index: i for i, r in enumerate(s.rounds)}

    def memory(self, wire: torch.Tensor | None = None) -> Callable[[int, int], torch.Tensor]:
        tables = self.memory_tables

        def get(kind: int, i: int) -> torch.Tensor:
            if kind == WIRE:
                return wire
            try:
                return tables[kind][i]
            except KeyError:
                raise ExecutionError(f"schedule names {KIND_NAMES[kind]} tensor {i}, which this process does "
                                     f"not hold") from None
        return get

    def _run(self, program: list, wire: torch.Tensor | None = None) -> None:
        self.copies += len(program)
        run_copies(program, self.memory(wire))

    def _ops(self, rnd: Round, slot: int) -> tuple[list, list, list]:
        sends = [self.wire[slot, j, :m.numel] for j, m in enumerate(rnd.sends)]
        recvs = [self.wire[slot, len(rnd.sends) + j, :m.numel] for j, m in enumerate(rnd.recvs)]
        g = self.ex._global
        ops = ([dist.P2POp(dist.isend, b, g[m.peer], self.ex.group, tag=rnd.index) for b, m in zip(sends, rnd.sends)]
               + [dist.P2POp(dist.irecv, b, g[m.peer], self.ex.group, tag=rnd.index)
                  for b, m in zip(recvs, rnd.recvs)])
        return sends, recvs, ops

    def _describe(self, rnd: Round) -> str:
        parts = [f"send {m.numel * self.ex.plan.itemsize} B to group rank {m.peer}" for m in rnd.sends]
        parts += [f"receive {m.numel * self.ex.plan.itemsize} B from group rank {m.peer}" for m in rnd.recvs]
        return f"round {rnd.index} (stage {rnd.stage}: {', '.join(parts)})"

    def pack(self, rnd: Round, slot: int) -> None: ...
    def post(self, rnd: Round, slot: int): ...
    def complete(self, pending) -> None: ...
    def local(self, stage: int) -> None: ...
    def stage_barrier(self, stage: int) -> None: ...
    def drain(self) -> None: ...
    def commit(self) -> None: ...
    def abort(self) -> None: ...


class _HostEngine(_Engine):
    """CPU tensors over gloo: copies run on this thread while the transport moves earlier rounds."""

    def pack(self, rnd: Round, slot: int) -> None:
        progs = self.programs["rounds"][self.round_pos[rnd.index]][0]
        for j, prog in enumerate(progs):
            self._run(prog, self.wire[slot, j, :rnd.sends[j].numel])

    def post(self, rnd: Round, slot: int):
        sends, recvs, ops = self._ops(rnd, slot)
        works = dist.batch_isend_irecv(ops) if ops else []
        return rnd, recvs, works

    def complete(self, pending) -> None:
        rnd, recvs, works = pending
        timeout = timedelta(seconds=self.ex.timeout)
        for w in works:
            try:
                w.wait(timeout)
            except Exception as e:
                raise ExecutionError(self.ex._failure(f"{self._describe(rnd)} did not complete: {e}")) from e
        progs = self.programs["rounds"][self.round_pos[rnd.index]][1]
        with torch.no_grad():
            for buf, prog in zip(recvs, progs):
                self._run(prog, buf)

    def local(self, stage: int) -> None:
        with torch.no_grad():
            self._run(self.programs["local"][stage])

    def stage_barrier(self, stage: int) -> None:
        pass  # rounds complete on this thread: stage s is done when stage s+1 starts

    def drain(self) -> None:
        pass

    def commit(self) -> None:
        with torch.no_grad():
            self._run(self.programs["commit"])
            self._run(self.programs["deferred"])

    def abort(self) -> None:
        pass


class _CudaEngine(_Engine):
    """GPU tensors over NCCL: pack, transfer, scatter and local copies on their own streams, ordered by events;
    the host only enqueues, then polls each round's completion event against the timeout."""

    def __init__(self, ex: DistributedExecutor, device: torch.device, src: dict, dst: dict) -> None:
        super().__init__(ex, device, src, dst)
        self.streams = {k: torch.cuda.Stream(device) for k in ("pack", "scatter", "local", "post")}
        entry = torch.cuda.current_stream(device).record_event()
        for st in self.streams.values():
            st.wait_event(entry)  # the caller's writes to the source tensors come first
        self.slot_owner: dict[int, dict] = {}
        self.done: list = []  # (event, what) per round, in order
        self.local_done: dict[int, torch.cuda.Event] = {}
        self.last_scatter: torch.cuda.Event | None = None

    def pack(self, rnd: Round, slot: int) -> None:
        prev = self.slot_owner.get(slot)
        with torch.cuda.stream(self.streams["pack"]), torch.no_grad():
            if prev is not None:
                for w in prev["works"]:
                    w.wait()  # the slot's earlier sends have left
            progs = self.programs["rounds"][self.round_pos[rnd.index]][0]
            for j, prog in enumerate(progs):
                self._run(prog, self.wire[slot, j, :rnd.sends[j].numel])
            self.packed = self.streams["pack"].record_event()

    def post(self, rnd: Round, slot: int):
        prev = self.slot_owner.get(slot)
        post = self.streams["post"]
        post.wait_event(self.packed)
        if prev is not None:
            post.wait_event(prev["scattered"])  # the slot's earlier receives were scattered
        sends, recvs, ops = self._ops(rnd, slot)
        with torch.cuda.stream(post):
            works = dist.batch_isend_irecv(ops) if ops else []
        pending = {"rnd": rnd, "recvs": recvs, "works": works, "scattered": None}
        self.slot_owner[slot] = pending
        return pending

    def complete(self, pending) -> None:
        rnd = pending["rnd"]
        scatter = self.streams["scatter"]
        with torch.cuda.stream(scatter), torch.no_grad():
            for w in pending["works"]:
                w.wait()
            progs = self.programs["rounds"][self.round_pos[rnd.index]][1]
            for buf, prog in zip(pending["recvs"], progs):
                self._run(prog, buf)
            ev = scatter.record_event()
        pending["scattered"] = ev
        self.last_scatter = ev
        self.done.append((ev, self._describe(rnd)))

    def local(self, stage: int) -> None:
        st = self.streams["local"]
        with torch.cuda.stream(st), torch.no_grad():
            self._run(self.programs["local"][stage])
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
        what = [w for _, w in self.done] + [f"local copies of stage {s}" for s in self.local_done]
        try:
            _poll(events, self.ex.timeout, lambda: "", what)
        except ExecutionError as e:
            raise ExecutionError(self.ex._failure(str(e))) from None

    def commit(self) -> None:
        cur = torch.cuda.current_stream(self.device)
        for st in self.streams.values():
            cur.wait_stream(st)
        with torch.no_grad():
            self._run(self.programs["commit"])
            self._run(self.programs["deferred"])
        cur.synchronize()

    def abort(self) -> None:
        _abort(self.ex.group)


def execute_distributed(plan: Plan, binding: Binding, src: RankTensors | None, dst: RankTensors | None,
                        group: dist.ProcessGroup | None = None, **options) -> ExecutionStats:
    """One refit with a fresh executor (build a `DistributedExecutor` to reuse schedule and buffers)."""
    return DistributedExecutor(plan, binding, group, **options).run(src, dst)
