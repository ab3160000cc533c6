"""The process group a refit runs over: its members, one all-reduce, batched point-to-point messages, lanes.

`GroupComm` is a group of this process's torch.distributed world; `StoreComm` a group made directly over a store
(a TCPStore both sides reach), outside either side's world: trainer processes and the workers of a separate vLLM
server join it for refits, and its messages go through the process-group objects themselves. Peers are ranks in
the refit group; one batch's messages are posted together (NCCL: one group call, so no pair can deadlock).
"""
from __future__ import annotations

import abc
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ...errors import ExecutionError
from . import lanes

Message = tuple[torch.Tensor, int, int]  # (buffer, peer group rank, tag)


class Comm(abc.ABC):
    """The group a `CollectiveExecutor` runs over: its members (`rank` of `size`), its backend and its lanes
    (communicators over the same members: lanes.py)."""
    rank: int
    size: int
    backend: str  # "gloo" or "nccl"
    lanes: list[Any]  # communicators; lanes[0] is the group itself

    @abc.abstractmethod
    def all_reduce_max(self, t: torch.Tensor) -> Any:
        """Start an element-wise MAX all-reduce of `t` over the group; returns its work."""

    @abc.abstractmethod
    def prepare(self, lane: int, sends: Sequence[Message], recvs: Sequence[Message]) -> Any:
        """Build one batch of messages on lane `lane` (built once, posted at every refit)."""

    @abc.abstractmethod
    def post(self, batch: Any) -> list[Any]:
        """Post a prepared batch (all its sends and receives together); returns the works to wait for."""

    def lane_name_count(self) -> int:
        """What the next lane would be named after (-1: unknown); members whose counts differ make no lanes."""
        return 0

    @abc.abstractmethod
    def make_lanes(self, n: int, timeout: float | None = None) -> None:
        """Grow `lanes` to n communicators (a collective of the group; failures leave fewer), each bounding its
        waits by `timeout` seconds."""

    def forget_lanes(self) -> None:
        """After an abort the lanes are unusable: forget them."""

    def close(self) -> None:
        """Release what this comm made (a StoreComm's groups: their sockets and threads); unusable afterwards."""

    def global_peer(self, peer: int) -> int:
        """An identity for `peer` that is unique in this process (for remembering connected pairs)."""
        return peer


class GroupComm(Comm):
    """A group of this process's torch.distributed world (default: the whole world)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            raise ExecutionError("this process is not a member of the refit group; only members call the executor")
        self.size = dist.get_world_size(self.group)
        self.backend = str(dist.get_backend(self.group)).lower()
        self.lanes = [self.group]

    def global_peer(self, peer: int) -> int:
        return peer if self.group is dist.group.WORLD else dist.get_global_rank(self.group, peer)

    def all_reduce_max(self, t: torch.Tensor) -> Any:
        return dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def prepare(self, lane: int, sends: Sequence[Message], recvs: Sequence[Message]) -> Any:
        group = self.lanes[lane]
        return ([dist.P2POp(dist.isend, b, self.global_peer(p), group, tag=t) for b, p, t in sends]
                + [dist.P2POp(dist.irecv, b, self.global_peer(p), group, tag=t) for b, p, t in recvs])

    def post(self, batch: Any) -> list[Any]:
        return dist.batch_isend_irecv(batch) if batch else []

    def lane_name_count(self) -> int:
        return lanes.naming_count(self.group)

    def make_lanes(self, n: int, timeout: float | None = None) -> None:
        self.lanes = lanes.lanes_for(self.group, n, self.backend, timeout)

    def forget_lanes(self) -> None:
        lanes.forget(self.group)


class StoreComm(Comm):
    """A group made over a store by its `size` members, each with its own `rank` (module docstring); lane i is a
    process group of its own under the store prefix `lane<i>/`."""

    def __init__(self, store: Any, rank: int, size: int, backend: str = "gloo", timeout: float = 300.0) -> None:
        if not 0 <= rank < size:
            raise ExecutionError(f"rank={rank} is outside the group's [0, {size})")
        if backend not in ("gloo", "nccl"):
            raise ExecutionError(f"backend={backend!r} is not one of ('gloo', 'nccl')")
        self.store, self.rank, self.size, self.backend = store, rank, size, backend
        self.timeout = timedelta(seconds=timeout)
        self.lanes = [self._new_group(0)]

    def _new_group(self, lane: int) -> Any:
        store = dist.PrefixStore(f"lane{lane}/", self.store)
        try:  # gloo connects to every member here, waiting at most the group's timeout
            if self.backend == "gloo":
                return dist.ProcessGroupGloo(store, self.rank, self.size, gloo_options(self.timeout))
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            return dist.ProcessGroupNCCL(store, self.rank, self.size, options)
        except (RuntimeError, OSError) as e:  # torch's DistStoreError / DistNetworkError: a member never came
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ExecutionError(f"set-up: making the {self.backend} group (lane {lane}) of {self.size} members "
                                 f"did not complete within {self.timeout.total_seconds():.1f} s on rank "
                                 f"{self.rank}: {first}") from e

    def all_reduce_max(self, t: torch.Tensor) -> Any:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        return self.lanes[0].allreduce([t], opts)

    def prepare(self, lane: int, sends: Sequence[Message], recvs: Sequence[Message]) -> Any:
        return self.lanes[lane], tuple(sends), tuple(recvs)

    def post(self, batch: Any) -> list[Any]:
        pg, sends, recvs = batch
        if not sends and not recvs:
            return []
        coalesce = self.backend == "nccl"
        if coalesce:  # one NCCL group call (a backend, not a ProcessGroup: its coalescing calls take no device)
            pg._start_coalescing()
        works = [pg.send([b], p, t) for b, p, t in sends] + [pg.recv([b], p, t) for b, p, t in recvs]
        if coalesce:
            return [pg._end_coalescing()]
        return works

    def make_lanes(self, n: int, timeout: float | None = None) -> None:
        while len(self.lanes) < n:  # each lane has the group's own timeout
            self.lanes.append(self._new_group(len(self.lanes)))

    def forget_lanes(self) -> None:
        self.lanes = self.lanes[:1]

    def close(self) -> None:
        """Shut the lanes down, within the group's timeout (a shutdown waiting on a frozen peer is left behind)."""
        from ..base import close_within

        groups, self.lanes = self.lanes, []

        def shut_down() -> None:
            for pg in groups:
                for stop in ("shutdown", "abort"):
                    try:
                        getattr(pg, stop)()
                        break
                    except Exception:  # noqa: BLE001 - best effort: a broken group may refuse either
                        continue

        close_within(shut_down, self.timeout.total_seconds(), f"shutting down the {self.backend} group's lanes")


def gloo_options(timeout: timedelta) -> Any:
    """A gloo group's options: its device bound to this host's routable address (reshard.addresses) unless
    GLOO_SOCKET_IFNAME chooses the interface (gloo's default resolves the host name, often to loopback)."""
    import os

    from ...addresses import routable_address

    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
    else:
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=routable_address())]
    return options


def comm_for(group: Any) -> Comm | None:
    """`group` itself when it is a Comm, else a GroupComm over it (default: the whole world); None when
    torch.distributed is not initialized and no group was given (one process playing every rank)."""
    if isinstance(group, Comm):
        return group
    if dist.is_available() and dist.is_initialized():
        return GroupComm(group)
    if group is not None:
        raise ExecutionError("a process group was given but torch.distributed is not initialized")
    return None


__all__ = ["Comm", "GroupComm", "Message", "StoreComm", "comm_for"]
