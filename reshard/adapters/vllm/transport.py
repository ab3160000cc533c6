"""How a plan's bytes reach a vLLM worker: pluggable transports, selected by name in the engine's init info.

A `Transport` receives this process's destination ranks' part of a plan into given tensors:

    transport = make_transport("inprocess", {"key": "run-1"})   # once per engine
    transport.run(plan, {rank: {name: tensor}})                 # every refit; every process of the refit
    transport.close()                                            # at shutdown

Transports here:
  - "inprocess": the sources live in this process (`publish_source`): a trainer colocated with an in-process
    engine, and the tests. Copies run straight from the source tensors.
A torch.distributed (NCCL / gloo) and a NIXL transport plug in with `register_transport`; they run the same
plan with the executors in reshard.executors (any callable `run(plan, dst)` fits).
"""
from __future__ import annotations

import abc
from typing import Any, Callable, Mapping

import numpy as np
import torch

from ...errors import ExecutionError
from ...executors.local import block, check_tensors
from ...planner import Plan
from ...planner.plan import RELAY

RankTensors = Mapping[int, Mapping[str, torch.Tensor]]


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
        ops = plan.ops
        mine = np.flatnonzero(np.isin(ops["dst_rank"], list(dst)))
        relays = mine[ops["src_side"][mine] == RELAY]
        foreign = sorted(set(ops["src_rank"][relays].tolist()) - set(dst))
        if foreign:
            raise ExecutionError(f"the plan relays through destination ranks {foreign[:10]} that are not in this "
                                 f"process; compile it without fan-out for an in-process transport")
        needed = sorted(set(ops["src_rank"][mine[ops["src_side"][mine] != RELAY]].tolist()))
        missing = [r for r in needed if r not in self.src]
        if missing:
            raise ExecutionError(f"in-process transport lacks source ranks {missing[:10]}")
        check_tensors(plan, {r: self.src[r] for r in needed}, dst)
        s_flat = {i: self.src[r][n].view(-1) for i, (r, n) in enumerate(zip(plan.src_tensors.ranks,
                                                                             plan.src_tensors.names)) if r in self.src}
        d_flat = {i: dst[r][n].view(-1) for i, (r, n) in enumerate(zip(plan.dst_tensors.ranks,
                                                                         plan.dst_tensors.names)) if r in dst}
        cols = [ops[c][mine].tolist() for c in ("src_side", "src_tensor", "src_offset", "src_stride", "dst_tensor",
                                                  "dst_offset", "dst_stride", "rows", "cols")]
        with torch.no_grad():
            for side, st, so, ss, dt, do, ds, r, c in zip(*cols):  # ops are in stage order
                src = d_flat[st] if side == RELAY else s_flat[st]
                block(d_flat[dt], do, r, c, ds).copy_(block(src, so, r, c, ss))


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


register_transport("inprocess", lambda options: PublishedTransport(str(options.get("key", "default"))))
