"""Run a plan between processes of one host through shared memory: CUDA IPC on GPUs (a trainer and a vLLM engine
sharing a GPU, NeMo-RL's colocated shape), POSIX shared memory between CPU processes (the same path, run in CI).

A receiving process exposes landing memory for the destination tensors peers write; each sender maps it (handles
travel as JSON through the store, never pickle) and copies its blocks straight in. Per refit a receiver announces
"ready v", each sender copies, synchronizes and announces "done v", and every process votes (executors.voted).
Staged (default), landing memory is a staging arena committed after the vote; in place, it is the destination
itself (CPU tensors must then come from `shared_empty`). Segments of killed processes are removed later by
`reclaim_segments`. Fan-out relays are refused. Delta refits (CPU): executors.delta.VotedDelta.
"""
from __future__ import annotations

import base64
import contextlib
import logging
import mmap
import multiprocessing.util
import os
import re
import secrets
import stat
import threading
import time
from typing import Any

import numpy as np
import torch

from ..errors import ExecutionError
from ..planner import Plan
from ..planner.plan import RELAY
from .base import RankTensors, RefitStats
from .binding import Binding
from .checksum import fixed_digest, mismatch
from .copies import DST, PEER, SHADOW, SRC, Copies, Memory, view_copies
from .delta import DeltaPolicy, VotedDelta
from .exchange import Exchange, same_refit
from .reference import torch_dtype
from .partition import Partition, op_copies
from .voted import VotedExecutor

_SHM_DIR = "/dev/shm"
# reshard-<creator pid>-<start time, ticks after boot>-<pid namespace inode>-<128 random bits> (reclaim_segments
# proves the creator gone from them); the older reshard-<pid>-<32 hex> is opened, never reclaimed.
_SEGMENT_NAME = re.compile(r"reshard-[0-9]{1,10}-(?:[0-9]{1,20}-[0-9]{1,20}-)?[0-9a-f]{32}")
_RECLAIMABLE = re.compile(r"reshard-(?P<pid>[0-9]{1,10})-(?P<start>[0-9]{1,20})-(?P<ns>[0-9]{1,20})-[0-9a-f]{32}")
_UNKNOWN = -1  # a process whose start time cannot be read (not ours to judge): its segments are kept
_reclaimed_in: int | None = None  # the pid of the process whose shared_empty reclaimed (a fork child does again)
log = logging.getLogger("reshard")


# --- shared memory on CPU -------------------------------------------------------------------------------------

class Segment:
    """A POSIX shared-memory segment (a file under /dev/shm) mapped into this process as a uint8 tensor."""

    _lock = threading.Lock()
    _mine: dict[int, "Segment"] = {}  # data_ptr of segments this process created -> segment (for `exportable`)

    def __init__(self, name: str, nbytes: int = 0, create: bool = False) -> None:
        if not isinstance(name, str) or not _SEGMENT_NAME.fullmatch(name):
            raise ExecutionError(f"invalid shared-memory segment name {name!r} (reshard's are "
                                 f"reshard-<pid>-<start>-<pid namespace>-<32 hex digits>)")
        self.name, self.created = name, create
        path = os.path.join(_SHM_DIR, name)
        flags = os.O_RDWR | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0) | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as e:
            raise ExecutionError(f"cannot {'create' if create else 'open'} shared memory {path}: {e}") from e
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
                raise ExecutionError(f"shared memory {path} is not a private (0600) file of this user: refused")
            if create:
                os.fchmod(fd, 0o600)  # whatever the umask: peers of this user open it read-write, nobody else
                os.ftruncate(fd, max(nbytes, 1))
            size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.nbytes = size
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        if create:
            with Segment._lock:
                Segment._mine[self.tensor.data_ptr()] = self

    @classmethod
    def new(cls, nbytes: int) -> "Segment":
        """A segment of `nbytes` this process creates, under a fresh name (`_fresh_name`)."""
        return cls(_fresh_name(), nbytes, create=True)

    def unlink(self) -> None:
        """Remove the segment's file if this process created it (the mapping stays usable; no-op otherwise)."""
        if self.created:
            with Segment._lock:
                Segment._mine.pop(self.tensor.data_ptr(), None)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(_SHM_DIR, self.name))

    @classmethod
    def holding(cls, t: torch.Tensor) -> tuple["Segment", int] | None:
        """The segment this process created that holds `t`, and `t`'s byte offset in it."""
        ptr = t.data_ptr()
        with cls._lock:
            for base, seg in cls._mine.items():
                if base <= ptr and ptr + t.numel() * t.element_size() <= base + seg.nbytes:
                    return seg, ptr - base
        return None


def shared_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor in a shared-memory segment of its own, which peers of a "shared" refit can write
    into (in_place). Its name is removed at process exit; a killed process's is reclaimed later (`reclaim_segments`,
    run by a process's first call here)."""
    global _reclaimed_in
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if _reclaimed_in != os.getpid():
        _reclaimed_in = os.getpid()
        reclaim_segments()
    seg = Segment.new(numel * dtype.itemsize)
    # at exit, also of a multiprocessing child (which ends with os._exit, skipping atexit, but runs these)
    multiprocessing.util.Finalize(seg, seg.unlink, exitpriority=10)
    return seg.tensor[:numel * dtype.itemsize].view(dtype).view(shape)


def release_shared(t: torch.Tensor) -> None:
    """Remove the name of the segment this process made for `t` (shared_empty) once no new peer will map it; the
    memory lives on in the mappings."""
    held = Segment.holding(t)
    if held is not None:
        held[0].unlink()


def _fresh_name() -> str:
    """A new segment name: who made it (pid, start time, pid namespace; 0s where unreadable, never reclaimed)
    and 128 random bits, so only processes told the name open it."""
    me = _identity()
    start, ns = (me[1], me[2]) if me is not None else (0, 0)
    return f"reshard-{os.getpid()}-{start}-{ns}-{secrets.token_hex(16)}"


def _start_time(pid: int) -> int | None:
    """When process `pid` started (ticks after boot, /proc/<pid>/stat field 22); None: no such process;
    _UNKNOWN: unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return _UNKNOWN
    try:  # after the command name, which is in parentheses and may hold spaces and parentheses itself
        return int(stat_line[stat_line.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        return _UNKNOWN


def _identity() -> tuple[int, int, int] | None:
    """This process's (pid, start time, pid namespace inode), or None where /proc cannot vouch for them (none, or
    another pid namespace's)."""
    pid = os.getpid()
    try:
        with open("/proc/self/stat", "rb") as f:
            seen = int(f.read().split(b" ", 1)[0])
        ns = os.stat("/proc/self/ns/pid").st_ino
    except (OSError, ValueError):
        return None
    start = _start_time(pid)
    if seen != pid or start is None or start == _UNKNOWN or start <= 0 or ns <= 0:
        return None
    return pid, start, ns


def reclaim_segments() -> list[str]:
    """Remove the shared-memory segments of reshard processes that are gone (a SIGKILLed process cannot remove its
    own), and return their names: only a regular file of this user, named by `_fresh_name` in this pid namespace,
    whose creator is provably gone (no process has its pid, or the one that has it started at another time). A live
    peer keeps the memory it mapped. Safe to call at any time."""
    me = _identity()
    if me is None:
        return []
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return []
    starts: dict[int, int | None] = {}
    removed = []
    for name in names:
        m = _RECLAIMABLE.fullmatch(name)
        if m is None or int(m["ns"]) != me[2] or int(m["start"]) <= 0:
            continue
        pid, start = int(m["pid"]), int(m["start"])
        if pid not in starts:
            starts[pid] = _start_time(pid)
        now = starts[pid]
        if now == _UNKNOWN or now == start:  # not readable, or the creator itself still runs
            continue
        path = os.path.join(_SHM_DIR, name)
        try:
            info = os.lstat(path)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                continue
            os.unlink(path)
        except OSError:  # removed meanwhile (another process reclaiming), or not ours to remove
            continue
        removed.append(name)
    if removed:
        log.info("reshard: removed %d shared-memory segments of processes that are gone (%s%s)", len(removed),
                 ", ".join(removed[:3]), ", ..." if len(removed) > 3 else "")
    return removed


# --- handles ----------------------------------------------------------------------------------------------

def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def export(t: torch.Tensor) -> dict[str, Any]:
    """JSON fields a peer opens a flat tensor's memory with: a segment and offset on CPU, a CUDA IPC handle on
    GPUs."""
    if t.device.type == "cuda":
        device, handle, size, offset, ref, ref_off, event, sync = t.untyped_storage()._share_cuda_()
        return {"cuda": {"device": int(device), "handle": _b64(handle), "size": int(size), "offset": int(offset),
                         "ref": _b64(ref), "ref_offset": int(ref_off), "event": _b64(event or b""),
                         "sync": bool(sync)},
                "byte_offset": t.storage_offset() * t.element_size(), "numel": t.numel()}
    held = Segment.holding(t)
    if held is None:
        raise ExecutionError("a CPU tensor peers write into must live in shared memory (allocate it with "
                             "executors.shared.shared_empty, or refit staged)")
    seg, off = held
    return {"shm": seg.name, "byte_offset": off, "numel": t.numel()}


def open_handle(h: dict[str, Any], dtype: torch.dtype, device: torch.device, segments: dict[str, Segment]) \
        -> torch.Tensor:
    """The flat tensor a peer exported (`export`)."""
    try:
        numel, off = int(h["numel"]), int(h["byte_offset"])
        if "cuda" in h:
            c = h["cuda"]
            storage = torch.UntypedStorage._new_shared_cuda(
                int(c["device"]), base64.b64decode(c["handle"]), int(c["size"]), int(c["offset"]),
                base64.b64decode(c["ref"]), int(c["ref_offset"]), base64.b64decode(c["event"]) or None,
                bool(c["sync"]))
            flat = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        else:
            name = str(h["shm"])
            if name not in segments:
                segments[name] = Segment(name)
            flat = segments[name].tensor
    except (KeyError, TypeError, ValueError) as e:
        raise ExecutionError(f"a peer's memory handle is malformed ({type(e).__name__}: {e})") from e
    if off < 0 or numel < 0 or off + numel * dtype.itemsize > flat.numel() or off % dtype.itemsize:
        raise ExecutionError(f"a peer's memory handle points outside its memory ({off} + {numel} elements)")
    return flat[off:off + numel * dtype.itemsize].view(dtype)


# --- the executor -----------------------------------------------------------------------------------------

class SharedExecutor(VotedExecutor):
    """One process's part of a plan between processes of one host (see the module docstring).

    Args:
        store: a torch.distributed store every process of the binding reaches.
        staged: land bytes in a staging arena, committed after the vote (default), or write in place.
        timeout: seconds any wait of a refit may take.
        checksum: True / "sha256" / "sum64": receivers check each sender's digest before the vote
            (executors.checksum).
        delta: a `DeltaPolicy` (CPU tensors): refits move only changed elements; `last_delta` says what.
    """

    name = "shared"
    label = "shared-memory"

    def __init__(self, plan: Plan, binding: Binding, process: int, src: RankTensors, dst: RankTensors, *,
                 store: Any, staged: bool = True, timeout: float = 60.0, namespace: str = "default",
                 poll_max_s: float = 0.0002, checksum: bool | str = False,
                 delta: "DeltaPolicy | None" = None) -> None:
        binding.check(plan.src.num_ranks, plan.dst.num_ranks)  # before the process is looked up in it
        if process not in binding.processes:
            raise ExecutionError(f"process {process} plays no rank of {binding}")
        if plan.num_ops and bool((plan.ops["src_side"] == RELAY).any()):
            raise ExecutionError("the shared-memory executor runs plans without fan-out relays (compile without "
                                 "fanout: on one host every receiver is fed by the sources directly)")
        self._open(plan, binding, process, src, dst, timeout, poll_max_s, checksum)
        self.part, self.staged, self.dtype = Partition(plan, binding, process), staged, torch_dtype(plan.dst.dtype)
        self.num_processes = len(binding.processes)
        self._segments: dict[str, Segment] = {}
        self._created: list[Segment] = []
        self._landed = np.flatnonzero(self.part.in_flight).tolist()  # destination tensors peers write into
        self._feeders = sorted(self.part.receives_from)
        self._delta = None if delta is None else _SharedDelta(self, delta)
        if self.device.type != "cuda":  # the segments killed processes left behind, before this one makes its own
            reclaim_segments()
        self.exchange = Exchange(store, namespace, transport="shared")
        try:
            self._set_up()
        except BaseException as e:
            self.exchange.fail_setup(self.process, str(e) or repr(e))  # peers still fetching stop now
            self.close()
            raise

    # --- construction --------------------------------------------------------------------------------
    def _set_up(self) -> None:
        self._landing: dict[int, torch.Tensor] = {}  # my landing memory per destination tensor id
        self._staging_bytes = 0
        if self._landed and self.staged:
            sizes = {i: self.dst_flat[i].numel() for i in self._landed}
            arena, self._landing = self.prepared.arena(sizes, allocate=self._arena)
            self._staging_bytes = arena.numel() * self.itemsize
        elif self._landed:
            self._landing = {i: self.dst_flat[i] for i in self._landed}
        book = {"process": self.process, "plan": self.plan.digest, "binding": self.binding.to_dict(),
                "staged": self.staged, "device": str(self.device.type), "checksum": self.checksum,
                "delta": None if self._delta is None else self._delta.policy.keyframe_every,
                "landing": {str(i): export(t) for i, t in self._landing.items()}}
        self.exchange.publish(self.process, b"", book)
        self._peer_landing: dict[tuple[int, int], torch.Tensor] = {}
        deadline = time.monotonic() + self.timeout
        for q in self.part.sends_to:  # check that each peer runs the same refit, map the memory it exposes here
            theirs = self.exchange.fetch(q, self.timeout, deadline)[1]
            same_refit(self.process, q, theirs, book, ("plan", "binding", "staged", "device", "checksum", "delta"))
            for tid in sorted(set(self.plan.ops["dst_tensor"][self.part.sends_to[q]].tolist())):
                h = theirs["landing"].get(str(tid))
                if h is None:
                    raise ExecutionError(f"process {q} exposes no memory for destination tensor {tid}")
                t = open_handle(h, self.dtype, self.device, self._segments)
                want = int(self.part.tensor_sizes[tid])
                if t.numel() != want:
                    raise ExecutionError(f"process {q}'s memory for destination tensor {tid} has {t.numel()} "
                                         f"elements, the plan's tensor {want}")
                self._peer_landing[(q, tid)] = t
        self._bind_programs()

    def _bind_programs(self) -> None:
        """Copy programs bound to this process's memory and its peers' (executors.copies), made once."""
        part = self.part
        flats = {SRC: self.src_flat, DST: self.dst_flat, SHADOW: self._landing}  # SHADOW: my landing memory

        def flat(kind: int, i: int) -> torch.Tensor:
            return flats[kind][i] if kind in flats else self._peer_landing[(kind - PEER, i)]

        memory = Memory(flat, self.itemsize)
        self._send_programs = {q: view_copies(op_copies(self.plan, ops, SRC, PEER + q), memory, self.itemsize)
                               for q, ops in part.sends_to.items()}
        shadowed = part.in_flight if self.staged else np.zeros_like(part.in_flight)
        local, deferred = part.local_copies(shadowed, ~part.in_flight if self.staged else None)
        self._local_program = view_copies(Copies.concat(local), memory, self.itemsize)
        self._commit_program = view_copies(Copies.concat([part.commit(shadowed), deferred]), memory, self.itemsize)
        self._shifts = self.prepared.shifts(part.landing)
        if self.checksum:  # the blocks each stream's checksum reads, in plan order (executors.checksum)
            self._sum_out = {q: fixed_digest(self.checksum, self.prepared.blocks(ops))
                             for q, ops in part.sends_to.items()}
            self._sum_in = {f: fixed_digest(self.checksum, self.prepared.blocks(ops, "dst", self._landing))
                            for f, ops in part.receives_from.items()}

    def _arena(self, numel: int) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.empty(numel, dtype=self.dtype, device=self.device)
        seg = Segment.new(numel * self.itemsize)
        self._created.append(seg)
        return seg.tensor[:numel * self.itemsize].view(self.dtype)

    # --- a refit -------------------------------------------------------------------------------------
    def _move(self, v: int, deadline: float) -> None:
        ex = self.exchange
        if self._landed:
            ex.signal(f"v{v}/ready/{self.process}")  # my landing memory is free
        self._run(self._local_program)  # copies into tensors peers write too: into their landing memory
        for q, program in self._send_programs.items():
            ex.wait_count(f"v{v}/ready/{q}", 1, v, deadline, self.poll_max_s, f"process {q} to be ready for refit {v}")
            self._run(program, sync=True)
            if self.checksum:
                ex.store.set(f"v{v}/sum/{self.process}/{q}", self._sum_out[q]())
            ex.signal(f"v{v}/done/{q}")
        if self._feeders:
            ex.wait_count(f"v{v}/done/{self.process}", len(self._feeders), v, deadline, self.poll_max_s,
                          f"processes {self._feeders} to write their bytes of refit {v}")
            if self.checksum:  # every feeder's bytes as they landed here hash to what it sent
                sent = {f: ex.store.get(f"v{v}/sum/{f}/{self.process}").decode() for f in self._feeders}
                bad = [mismatch(f"the bytes from process {f}", sent[f], got) for f in self._feeders
                       if (got := self._sum_in[f]()) != sent[f]]
                if bad:
                    raise ExecutionError("; ".join(bad))

    def _keys(self, previous: int) -> tuple[str, ...]:
        if previous == 0:  # every peer mapped our segments at set-up, before voting: their names can go
            for seg in self._created:
                seg.unlink()
        return (tuple(f"v{previous}/{k}/{p}" for k in ("ready", "done") for p in self.binding.processes)
                + tuple(f"v{previous}/sum/{f}/{self.process}" for f in self._feeders if self.checksum))

    def _dense_stats(self, **common: Any) -> RefitStats:
        return RefitStats(**common, staging_bytes=self._staging_bytes,
                          transfers=len(self.part.sends_to) + len(self._feeders))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._peer_landing = {}
        self._send_programs = {}
        self._segments.clear()
        if self._delta is not None:
            self._delta.close()
        for seg in self._created:
            seg.unlink()
        self._created.clear()


class _SharedDelta(VotedDelta):
    """A SharedExecutor's delta refits: each payload in a growing outbox segment per receiving peer."""

    def __init__(self, executor: SharedExecutor, policy: DeltaPolicy) -> None:
        super().__init__(executor, policy, executor.part, executor.checksum, cpu=True)
        self.outbox: dict[int, Segment] = {}  # receiving peer -> this sender's payload segment for it
        self.inbox: dict[int, Segment] = {}  # feeder -> its payload segment, mapped here

    def deliver(self, q: int, payload: torch.Tensor, v: int, deadline: float) -> dict[str, Any]:
        seg = self.outbox.get(q)
        if seg is None or seg.nbytes < payload.numel():  # grows geometrically: a few names over a run
            if seg is not None:
                seg.unlink()
            size = max(payload.numel(), 2 * (seg.nbytes if seg else 0), 4096)
            seg = self.outbox[q] = Segment.new(size)
        seg.tensor[:payload.numel()].copy_(payload)
        return {"shm": seg.name}

    def arrived(self, f: int, where: dict[str, Any], n: int, v: int, deadline: float) -> torch.Tensor:
        seg = self.inbox.get(f)
        if seg is None or seg.name != where.get("shm"):
            seg = self.inbox[f] = Segment(str(where.get("shm")))
        if n > seg.nbytes:
            raise ExecutionError(f"process {f} announced a delta of {n} bytes in a segment of {seg.nbytes}")
        return seg.tensor[:n]

    def commit(self) -> bool:
        for seg in self.outbox.values():  # every receiver mapped it before it voted: a killed process leaves none
            seg.unlink()
        return super().commit()

    def close(self) -> None:
        for seg in self.outbox.values():
            seg.unlink()
        self.outbox.clear()
        self.inbox.clear()


__all__ = ["SharedExecutor", "export", "open_handle", "reclaim_segments", "release_shared", "shared_empty"]
