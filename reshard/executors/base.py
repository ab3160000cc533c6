"""What every executor is, and the one place that picks an executor by name.

An executor is built once per plan, binding (which process plays which rank), process and tensors (`src` / `dst`:
rank -> name -> tensor), preparing what it can; `refit(version=None)` moves one refit and returns a `RefitStats`
or raises ExecutionError (staged by default: a failed refit leaves every destination unchanged); `close()`
releases what it holds. `make_executor` imports an executor's module (`EXECUTORS`) on first use.
"""
from __future__ import annotations

import abc
import importlib
import logging
import time
from typing import Any, Mapping

import torch

from ..errors import ExecutionError
from ..polling import Background
from .stats import RefitStats

RankTensors = Mapping[int, Mapping[str, torch.Tensor]]
"""A process's tensors of some plan ranks: rank -> physical tensor name -> tensor."""

EXECUTORS = {"reference": "reshard.executors.reference:ReferenceExecutor",
             "inprocess": "reshard.executors.inprocess:InProcessExecutor",
             "collective": "reshard.executors.collective.executor:CollectiveExecutor",
             "nixl": "reshard.executors.nixl.executor:NixlExecutor",
             "shared": "reshard.executors.shared:SharedExecutor"}


class Executor(abc.ABC):
    """The protocol every executor follows (module docstring); subclasses set `name`, their key in `EXECUTORS`."""

    name: str = ""

    @abc.abstractmethod
    def refit(self, version: int | None = None) -> "RefitStats":
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


__all__ = ["EXECUTORS", "Executor", "RankTensors", "close_within", "make_executor"]
