"""What every executor is: one process's part of a plan, bound once and run at every refit; and the one place
that picks an executor by name.

Lifecycle, the same for every executor:
  1. construction binds the plan to where its ranks live (a `Binding`: which process plays which rank), to this
     process (`process`) and to its tensors (`src`: source rank -> name -> tensor for the source ranks it plays,
     `dst` likewise), and prepares what can be prepared once (schedules, buffers, registrations, connections);
  2. `refit(version=None)` moves one refit: the source tensors hold the new weights; it returns a `RefitStats`
     (executors.stats: one type for every executor), or raises ExecutionError. Staged by default: a failed refit
     leaves every destination unchanged;
  3. `close()` releases what the executor holds (also on leaving a `with` block).

    executor = make_executor("collective", plan, binding, process, src, dst, group=group)
    for step in training:
        ...                       # the trainer updates its tensors in place
        executor.refit()
    executor.close()

Executors here, each named after the transport that opens it (the package docstring lists them): "inprocess",
"collective", "nixl", "shared", and "reference" (the ground truth). `EXECUTORS` lists them by name, each as the
module and class that define it; `make_executor` imports the module on first use, so `import reshard` pulls in none
of them.
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

# every executor: name -> "module:class" (the module imported on first use)
EXECUTORS = {"reference": "reshard.executors.reference:ReferenceExecutor",
             "inprocess": "reshard.executors.inprocess:InProcessExecutor",
             "collective": "reshard.executors.collective.executor:CollectiveExecutor",
             "nixl": "reshard.executors.nixl.executor:NixlExecutor",
             "shared": "reshard.executors.shared:SharedExecutor"}


class Executor(abc.ABC):
    """The protocol every executor follows: built once per plan and process, `refit()` per refit, `close()`.

    Subclasses set `name`, their entry in `EXECUTORS` (what `make_executor` picks them by).
    """

    name: str = ""

    @abc.abstractmethod
    def refit(self, version: int | None = None) -> "RefitStats":
        """Move one refit's bytes; returns what this process did (a `RefitStats`, the same type for every
        executor)."""

    def close(self) -> None:
        """Release buffers, registrations and connections."""

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def executor_class(name: str) -> type[Executor]:
    """The class of the executor called `name` (its module imported on first use)."""
    if name not in EXECUTORS:
        raise ExecutionError(f"unknown executor {name!r}; known: {sorted(EXECUTORS)}")
    module, cls = EXECUTORS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def make_executor(name: str, plan: Any, binding: Any, process: int, src: RankTensors | None,
                  dst: RankTensors | None, **options: Any) -> Executor:
    """The executor called `name`, bound to this process's part of `plan` (see the module docstring).

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
    instance("plan", plan, Plan, "a Plan")
    integer("process", process, 0, 1 << 20)
    rank_tensors("src", src, none=True)
    rank_tensors("dst", dst, none=True)
    return executor_class(name)(plan, binding, process, {} if src is None else src, {} if dst is None else dst,
                                **options)


def close_within(close: Any, timeout: float, what: str) -> bool:
    """Run a clean-up call for at most `timeout` seconds (bounded clean-up: a release waiting on a frozen peer
    must not hold its caller). True when it finished; else it is left to a daemon thread, a warning is logged
    and False returned. An error it raises is logged too: clean-up after a failure is best effort."""
    call = Background(close, name="reshard-close")
    if not call.join(time.monotonic() + timeout):
        logging.getLogger("reshard").warning("reshard: %s did not finish within %.1f s; left to a background "
                                             "thread", what, timeout)
        return False
    if call.error is not None:
        logging.getLogger("reshard").warning("reshard: %s failed: %s: %s", what, type(call.error).__name__,
                                             call.error)
    return True


__all__ = ["EXECUTORS", "Executor", "RankTensors", "close_within", "executor_class", "make_executor"]
