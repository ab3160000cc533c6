"""What every executor is, and the one place that picks an executor by name.

An executor is built once per plan, binding (which process plays which rank), process and tensors (`src` / `dst`:
rank -> name -> tensor), preparing what it can; `refit(version=None)` moves one refit and returns a `RefitStats`
or raises ExecutionError (staged by default: a failed refit leaves every destination unchanged); `close()`
releases what it holds. `make_executor` imports an executor's module (`EXECUTORS`) on first use. `RefitStats`
is the one record of what one process did in one refit (a quantity an executor does not have keeps its default).
"""
from __future__ import annotations

import abc
import importlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ..errors import ExecutionError
from ..polling import Background

RankTensors = Mapping[int, Mapping[str, torch.Tensor]]
"""A process's tensors of some plan ranks: rank -> physical tensor name -> tensor."""

EXECUTORS = {"reference": "reshard.executors.reference:ReferenceExecutor",
             "inprocess": "reshard.executors.inprocess:InProcessExecutor",
             "collective": "reshard.executors.collective.executor:CollectiveExecutor",
             "nixl": "reshard.executors.nixl.executor:NixlExecutor",
             "shared": "reshard.executors.shared:SharedExecutor"}


@dataclass(frozen=True)
class RefitStats:
    """What one process did in one refit.

    Attributes:
        executor: the executor's name ("reference", "inprocess", "collective", "nixl", "shared", "fp8").
        process: this process's index in the binding (its group rank for "collective").
        version: the refit's version (the previous one + 1 unless the caller gave one).
        seconds: wall clock, call to return.
        phases: wall clock per step, in order (e.g. transfer, agree, commit).
        staged: the refit landed in staging memory, copied into the destination at commit.
        undo: the refit wrote in place with a backup to restore on failure (distributed).
        ops: plan ops this process ran or received.
        copies: block copies launched, where the executor counts them.
        bytes_sent: peer process -> bytes this process sent it.
        bytes_received: peer process -> bytes this process received from it.
        local_bytes: bytes copied within this process.
        staging_bytes: staging memory (shadows, packed buffers) this process holds.
        transfers: point-to-point transfers this process took part in (messages, links, peers).
        checksum: the algorithm every transfer's bytes were checked with ("" when none).
        digest: hex digest of every byte this process landed, in plan order, where the executor computes one.
        rounds: rounds of messages (distributed).
        lanes: communicators the rounds were spread over (distributed).
        bucket_bytes: the largest message (distributed).
        direct_bytes: bytes sent from or received into the tensors themselves (distributed).
        wire_bytes: wire buffer memory (distributed).
        direction: "read" or "write": who posts the transfers (nixl).
        packed_transfers: transfers packed into one buffer (nixl).
        descriptors: descriptors of the transfers this process posts (nixl).
        pause_s: seconds the engines did not generate, first pause call to last resume answer (adapters.trainer);
            0 where none was paused or this process does not drive the engines.
        in_flight: vLLM's ids of the requests the engines held while paused, where they report them; None: not
            known.
    """

    executor: str
    process: int
    version: int
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)
    staged: bool = False
    undo: bool = False
    ops: int = 0
    copies: int = 0
    bytes_sent: dict[int, int] = field(default_factory=dict)
    bytes_received: dict[int, int] = field(default_factory=dict)
    local_bytes: int = 0
    staging_bytes: int = 0
    transfers: int = 0
    checksum: str = ""
    digest: str = ""
    rounds: int = 0
    lanes: int = 0
    bucket_bytes: int = 0
    direct_bytes: int = 0
    wire_bytes: int = 0
    direction: str = ""
    packed_transfers: int = 0
    descriptors: int = 0
    pause_s: float = 0.0
    in_flight: tuple[str, ...] | None = None


def phase_times(start: float, marks: list[tuple[str, float]]) -> tuple[float, dict[str, float]]:
    """(seconds since `start` to the last mark, seconds per phase) from (phase, time at its end) marks."""
    times = [start] + [t for _, t in marks]
    return times[-1] - start, {name: times[i + 1] - times[i] for i, (name, _) in enumerate(marks)}


class Executor(abc.ABC):
    """The protocol every executor follows (module docstring); subclasses set `name`, their key in `EXECUTORS`."""

    name: str = ""
    _delta: Any = None  # this process's side of the delta protocol, where the executor runs one (executors.delta)

    @property
    def last_delta(self) -> Any:
        """What this process sent in the last refit, with the `delta` option (executors.delta.DeltaReport); None
        without it."""
        return None if self._delta is None else self._delta.last

    @abc.abstractmethod
    def refit(self, version: int | None = None) -> RefitStats:
        """Move one refit's bytes; returns what this process did."""

    def close(self) -> None:
        """Release buffers, registrations and connections."""

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_executor(name: str, plan: Any, binding: Any, process: int, src: RankTensors | None,
                  dst: RankTensors | None, **options: Any) -> Executor:
    """The executor called `name`, bound to this process's part of `plan`.

    Args:
        name: "reference", "inprocess", "collective", "nixl" or "shared".
        plan: the plan.
        binding: which process plays each plan rank.
        process: this process's index in the binding.
        src: this process's source tensors (rank -> name -> tensor).
        dst: this process's destination tensors.
        **options: the executor's own options.

    Returns:
        The executor, ready to `refit()`.

    Raises:
        ExecutionError: an unknown name, or what the executor refuses at construction.
    """
    from ..arguments import instance, integer, rank_tensors, text
    from ..planner import Plan

    text("name", name)
    if name not in EXECUTORS:
        raise ExecutionError(f"unknown executor {name!r}; known: {sorted(EXECUTORS)}")
    instance("plan", plan, Plan, "a Plan")
    integer("process", process, 0, 1 << 20)
    rank_tensors("src", src, none=True)
    rank_tensors("dst", dst, none=True)
    module, cls = EXECUTORS[name].split(":")  # imported on first use
    return getattr(importlib.import_module(module), cls)(plan, binding, process, {} if src is None else src,
                                                         {} if dst is None else dst, **options)


def close_within(close: Any, timeout: float, what: str) -> bool:
    """Run a clean-up call for at most `timeout` seconds (a release waiting on a frozen peer must not hold its
    caller): True when it finished, else False (left to a daemon thread). Overruns and errors are logged."""
    call = Background(close, name="reshard-close")
    if not call.join(time.monotonic() + timeout):
        logging.getLogger("reshard").warning("reshard: %s did not finish within %.1f s; left to a background "
                                             "thread", what, timeout)
        return False
    if call.error is not None:
        logging.getLogger("reshard").warning("reshard: %s failed: %s: %s", what, type(call.error).__name__,
                                             call.error)
    return True


__all__ = ["EXECUTORS", "Executor", "RankTensors", "RefitStats", "close_within", "make_executor", "phase_times"]
