"""Transports by name: how a plan's bytes move between a refit's processes; `opener(Endpoint) -> Executor`.

Built in (each imports its executor only when opened):
  "inprocess"   trainer and engine in one process: the engine reads the trainer's published tensors;
  "colocated"   the trainer's processes are the engine's workers: the torch.distributed executor over `group`;
  "collective"  torch.distributed over a group joined at the rendezvous (gloo on CPU, NCCL on GPUs, or
                `options["backend"]`);
  "nixl"        NIXL one-sided transfers;
  "shared"      processes of one host: senders write into the receivers' memory (CUDA IPC, POSIX shared memory).
`register_transport` adds one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable

from ..arguments import instance, rank_tensors
from ..errors import ArgumentError, ExecutionError
from ..executors.base import Executor, RankTensors
from . import rendezvous as rv

if TYPE_CHECKING:
    from ..executors.base import RefitStats
    from ..planner import Plan


@dataclass(frozen=True)
class Endpoint:
    """What an opener binds: this process's part of a plan and where its peers meet.

    Attributes:
        plan, binding, process: the plan, who plays its ranks, this process.
        src, dst: this process's source / destination tensors (rank -> name -> tensor).
        options: the executor's own options; "key" names an in-process publication.
        store, rendezvous: the joined store and its `adapters.rendezvous.Rendezvous` (cross-process transports).
        namespace: unique per executor among those of one store (default: the rendezvous's refit id).
        comm: "collective": a StoreComm every process joined (else one is made from the store).
        group: "colocated": the engine's world group.
        delta: an executors.delta.DeltaPolicy (None: every refit dense).
    """

    plan: Any
    binding: Any
    process: int
    src: RankTensors
    dst: RankTensors
    options: dict[str, Any] = field(default_factory=dict)
    store: Any = None
    rendezvous: Any = None
    namespace: str = ""
    comm: Any = None
    group: Any = None
    delta: Any = None

    def scoped(self, transport: str) -> Any:
        """The part of the store this transport keeps its keys in (open_transport checked there is one)."""
        return rv.scoped(self.store, self.rendezvous, transport)

    @property
    def space(self) -> str:
        """The namespace this executor's keys live under (`namespace`, else the refit id)."""
        return self.namespace or self.rendezvous.refit_id


@dataclass(frozen=True)
class Transport:
    """A registered transport (see `register_transport`)."""

    name: str
    opener: Callable[[Endpoint], Executor]
    cross_process: bool = True
    in_place: dict[str, Any] = field(default_factory=dict)
    delta: bool = False


_TRANSPORTS: dict[str, Transport] = {}


def register_transport(name: str, opener: Callable[[Endpoint], Executor], *, cross_process: bool = True,
                       in_place: dict[str, Any] | None = None, delta: bool = False) -> None:
    """Make `opener` the transport `name` (a later registration of the name replaces it).

    Args:
        name: what RefitSpec.transport and the integrations' `transport` option name.
        opener: `opener(Endpoint) -> Executor`; it imports what it needs when called.
        cross_process: its processes meet at a rendezvous.
        in_place: executor options that write the destination tensors in place.
        delta: its opener passes `Endpoint.delta` to its executor (delta refits).
    """
    if not isinstance(name, str) or not name or not callable(opener):
        raise ArgumentError("name", name, "must be a non-empty string, with a callable opener")
    _TRANSPORTS[name] = Transport(name, opener, cross_process, dict(in_place or {}), bool(delta))


def transport(name: str) -> Transport:
    """The transport registered as `name`; ArgumentError (listing the registered ones) if none is."""
    if not isinstance(name, str) or name not in _TRANSPORTS:
        raise ArgumentError("transport", name, f"must be one of the registered transports {sorted(_TRANSPORTS)}")
    return _TRANSPORTS[name]


def transports() -> tuple[str, ...]:
    """The registered transports' names."""
    return tuple(sorted(_TRANSPORTS))


def cross_process_transports() -> tuple[str, ...]:
    """The registered transports whose processes meet at a rendezvous."""
    return tuple(sorted(n for n, t in _TRANSPORTS.items() if t.cross_process))


def open_transport(name: str, endpoint: Endpoint) -> Executor:
    """This process's executor for its part of `endpoint.plan` over the transport `name`.

    Raises ArgumentError for an unknown transport, ExecutionError for a cross-process transport without a
    rendezvous (refused here, before any opener runs: a registered opener need not check it) and for what the
    executor refuses.
    """
    chosen = transport(name)
    if chosen.cross_process and (endpoint.rendezvous is None or endpoint.store is None):
        raise ExecutionError(f"transport {name!r} needs a rendezvous (where the processes meet)")
    return chosen.opener(endpoint)


_PUBLISHED: dict[str, RankTensors] = {}


def publish_source(key: str, tensors: RankTensors) -> None:
    """Make source tensors (source rank -> name -> tensor) readable by engines in this process under `key`.

    The mappings are copied, the tensors shared: update them in place, or publish again. Raises ArgumentError
    for anything but such a mapping."""
    instance("key", key, str, "a string")
    rank_tensors("tensors", tensors, deep=True)
    _PUBLISHED[key] = MappingProxyType({r: MappingProxyType(dict(ts)) for r, ts in tensors.items()})


def withdraw_source(key: str) -> None:
    """Forget what was published under `key` (nothing if nothing was)."""
    _PUBLISHED.pop(key, None)


def published_source(key: str) -> RankTensors:
    """What is published under `key` in this process; ExecutionError if nothing is."""
    if key not in _PUBLISHED:
        raise ExecutionError(f"no source published under {key!r} in this process (the in-process transports need "
                             f"the trainer's tensors in the engine's process: publish_source first)")
    return _PUBLISHED[key]


class PublishedSource(Executor):
    """The in-process transport's engine side: each refit copies what is published under `key` into `dst`."""

    name = ""  # not picked by name: made by open_transport

    def __init__(self, plan: Plan, dst: RankTensors, key: str, checksum: "bool | str" = False,
                 delta: Any = None) -> None:
        from ..executors.checksum import algorithm

        self.plan, self.dst, self.key, self.delta = plan, dst, key, delta
        self.checksum = algorithm(checksum)
        self._bound: Any = None
        self._bound_to: Any = None  # the publication (publish_source) the inprocess executor reads

    def refit(self, version: int | None = None) -> RefitStats:
        from ..executors.inprocess import InProcessExecutor
        from ..executors.reference import ReferenceExecutor
        from ..planner.plan import RELAY

        src = published_source(self.key)
        if self._bound is None or src is not self._bound_to:  # republished (in-place swaps: the executor's pins)
            if bool((self.plan.ops["src_side"] == RELAY).any()):
                if self.checksum:
                    raise ExecutionError("checksum in process needs the inprocess executor, and this plan relays "
                                         "between destination replicas (compile it without fan-out)")
                return ReferenceExecutor(self.plan, None, 0, src, self.dst).refit()
            self._bound = None
            self._bound = InProcessExecutor(self.plan, None, 0, src, self.dst, checksum=self.checksum or False,
                                            delta=self.delta)
            self._bound_to = src
        return self._bound.refit(version)

    @property
    def last_delta(self) -> Any:
        """What the last refit moved, with the `delta` option (executors.delta.DeltaReport); else None."""
        return getattr(self._bound, "last_delta", None)

    def close(self) -> None:
        if self._bound is not None:
            self._bound.close()
        self._bound, self._bound_to = None, None


def _inprocess(e: Endpoint) -> Executor:
    return PublishedSource(e.plan, e.dst, str(e.options.get("key", "default")), e.options.get("checksum", False),
                           e.delta)


def _colocated(e: Endpoint) -> Executor:
    from ..executors import CollectiveExecutor

    options = dict(e.options)
    key = str(options.pop("key", "default"))
    mine = e.binding.src_ranks_of(e.process)
    published = published_source(key) if mine else {}
    missing = [r for r in mine if r not in published]
    if missing:
        raise ExecutionError(f"this process plays source ranks {list(mine)} but {missing} are not published "
                             f"under {key!r} (publish_source first)")
    return CollectiveExecutor(e.plan, e.binding, None, {r: published[r] for r in mine}, e.dst, group=e.group,
                              delta=e.delta, **options)


def _collective(e: Endpoint) -> Executor:
    from ..executors import make_executor

    options = dict(e.options)
    backend = options.pop("backend", None)
    comm = e.comm
    if comm is None:
        from ..executors.collective.comm import StoreComm

        on_gpu = any(t.device.type == "cuda" for side in (e.src, e.dst) for ts in side.values() for t in ts.values())
        comm = StoreComm(e.scoped("collective"), e.process, e.binding.num_processes,
                         backend or ("nccl" if on_gpu else "gloo"), options.get("timeout", e.rendezvous.timeout))
    return make_executor("collective", e.plan, e.binding, e.process, e.src, e.dst, group=comm, delta=e.delta, **options)


def _nixl(e: Endpoint) -> Executor:
    from ..executors import make_executor
    from ..executors.nixl import NixlOptions

    return make_executor("nixl", e.plan, e.binding, e.process, e.src, e.dst, store=e.scoped("nixl"),
                         options=NixlOptions(**e.options), namespace=e.space, delta=e.delta)


def _shared(e: Endpoint) -> Executor:
    from ..executors import make_executor

    return make_executor("shared", e.plan, e.binding, e.process, e.src, e.dst, store=e.scoped("shared"),
                         namespace=e.space, delta=e.delta, **e.options)


register_transport("inprocess", _inprocess, cross_process=False, delta=True)
register_transport("colocated", _colocated, cross_process=False, delta=True)
register_transport("collective", _collective, in_place={"in_place": True}, delta=True)
register_transport("nixl", _nixl, in_place={"staged": False}, delta=True)
register_transport("shared", _shared, in_place={"staged": False}, delta=True)

__all__ = ["Endpoint", "PublishedSource", "Transport", "cross_process_transports", "open_transport", "publish_source",
           "published_source", "register_transport", "transport", "transports", "withdraw_source"]
