"""How a plan's bytes reach a vLLM worker: pluggable transports, selected by name in the engine's init info.

A `Transport` receives this process's destination ranks' part of a plan into given tensors:

    transport = make_transport("inprocess", {"key": "run-1"})   # once per engine
    transport.run(plan, {rank: {name: tensor}})                 # every refit; every process of the refit
    transport.close()                                            # at shutdown

Transports here:
  - "inprocess": the sources live in this process (`publish_source`): a trainer colocated with an in-process
    engine, and the tests. Copies run straight from the source tensors.
  - "distributed": reshard's torch.distributed executor over a process group every trainer and vLLM process
    already belongs to -- the colocated case, where the trainer's processes are the vLLM workers (vLLM's
    `external_launcher`; its world group, NCCL on GPUs, gloo on CPU). Each process publishes the source ranks
    it plays (`publish_source`); one `run` call on every process sends, receives and commits (staged: a failed
    refit leaves every destination unchanged). Options: "key", and "binding" ({"src": [...], "dst": [...]},
    group ranks) when it is not the colocated one (source rank s and destination rank d on group ranks s, d).
Other transports (NIXL, trainer processes outside vLLM's world) plug in with `register_transport`.
"""
from __future__ import annotations

import abc
from typing import Any, Callable

from ...errors import ExecutionError
from ...executors.base import RankTensors
from ...executors.local import LocalExecutor
from ...planner import Plan


class Transport(abc.ABC):
    @abc.abstractmethod
    def run(self, plan: Plan, dst: RankTensors) -> None:
        """Fill this process's destination ranks (`dst`: rank -> name -> tensor) as the plan says; check the
        tensors against the plan before any byte moves."""

    def close(self) -> None:
        """Release what the transport holds."""


class LocalTransport(Transport):
    """Copies from source tensors held in this process (every source rank the plan reads for `dst`)."""

    def __init__(self, src: RankTensors):
        self.src = src

    def run(self, plan: Plan, dst: RankTensors) -> None:
        LocalExecutor(plan, None, 0, self.src, dst).refit()


# --- named transports for the weight-transfer engine -------------------------------------------------------

_PUBLISHED: dict[str, RankTensors] = {}
TransportFactory = Callable[[dict[str, Any]], Transport]
_TRANSPORTS: dict[str, TransportFactory] = {}


def publish_source(key: str, src: RankTensors) -> None:
    """Make source tensors (source rank -> name -> tensor) visible to in-process transports under `key`."""
    _PUBLISHED[key] = src


def withdraw_source(key: str) -> None:
    _PUBLISHED.pop(key, None)


def register_transport(name: str, factory: TransportFactory) -> None:
    if name in _TRANSPORTS and _TRANSPORTS[name] is not factory:
        raise ExecutionError(f"a different transport is already registered as {name!r}")
    _TRANSPORTS[name] = factory


def make_transport(name: str, options: dict[str, Any]) -> Transport:
    if name not in _TRANSPORTS:
        raise ExecutionError(f"unknown transport {name!r}; registered: {sorted(_TRANSPORTS)}")
    return _TRANSPORTS[name](dict(options))


class PublishedTransport(Transport):
    """In-process transport reading whatever source is published under `key` at each run."""

    def __init__(self, key: str):
        self.key = key

    def run(self, plan: Plan, dst: RankTensors) -> None:
        if self.key not in _PUBLISHED:
            raise ExecutionError(f"no source published under {self.key!r} in this process (publish_source first; "
                                 f"the in-process transport needs the trainer and the vLLM worker in one process)")
        LocalTransport(_PUBLISHED[self.key]).run(plan, dst)


class DistributedTransport(Transport):
    """The published source ranks of this process and `dst`, moved by a DistributedExecutor over `group`
    (default: the world group, vLLM's own in a worker). One executor per plan, reused across refits."""

    def __init__(self, key: str, binding: Any = None, group: Any = None, **executor_options: Any):
        self.key, self.binding, self.group, self.options = key, binding, group, executor_options
        self._executors: dict[str, Any] = {}

    def run(self, plan: Plan, dst: RankTensors) -> None:
        from ...executors import Binding, DistributedExecutor

        executor = self._executors.get(plan.digest)
        if executor is None:
            binding = self.binding or Binding.colocated(plan.src.num_ranks, plan.dst.num_ranks)
            executor = self._executors[plan.digest] = DistributedExecutor(plan, binding, group=self.group,
                                                                                            **self.options)
        mine = executor.binding.src_ranks_of(executor.rank)
        published = _PUBLISHED.get(self.key, {})
        missing = [r for r in mine if r not in published]
        if missing:
            raise ExecutionError(f"this process plays source ranks {list(mine)} but {missing} are not published "
                                 f"under {self.key!r} (publish_source first)")
        executor.refit(src={r: published[r] for r in mine}, dst=dst)

    def close(self) -> None:
        for executor in self._executors.values():
            release = getattr(executor, "release", None)
            if release is not None:
                release()
        self._executors.clear()


def _distributed(options: dict[str, Any]) -> Transport:
    binding = options.get("binding")
    if binding is not None:
        from ...executors import Binding

        binding = Binding(tuple(binding["src"]), tuple(binding["dst"]))
    return DistributedTransport(str(options.get("key", "default")), binding)


register_transport("inprocess", lambda options: PublishedTransport(str(options.get("key", "default"))))
register_transport("distributed", _distributed)
