"""A vLLM worker extension for refits driven by `collective_rpc` (stacks that call worker methods directly
instead of the weight-transfer API), e.g.

    llm = LLM(model=..., worker_extension_cls="reshard.adapters.vllm.worker.ReshardWorkerExtension")
    llm.collective_rpc("reshard_init", args=(refit.to_dict(),))        # a RefitSpec; raises before bytes move
    llm.collective_rpc("reshard_refit")                                 # start, receive, finish
    llm.collective_rpc("reshard_direct_problems")                       # why direct mode would be refused
    llm.collective_rpc("reshard_stats")                                 # plan compiles and cache hits

Importing this module registers the `reshard` weight-transfer engine in the worker process (vLLM imports the
extension class in every worker before building it), so the weight-transfer API can select it as well.
"""
from __future__ import annotations

import os
from typing import Any

from ...errors import LayoutMismatchError
from ..refit import RefitSpec
from .derive import representative_layers
from .direct import bind_direct
from .engine import register
from .live import declared_layout, local_rank, spec_of
from .session import WorkerSession

register()


class ReshardWorkerExtension:
    """Mixed into vLLM's worker class: `self` is the worker (model_runner, vllm_config)."""

    def _reshard_model(self) -> Any:
        return self.model_runner.get_model()

    def reshard_init(self, refit: dict[str, Any]) -> None:
        old = getattr(self, "_reshard_session", None)
        if old is not None:
            old.close()
        self._reshard_session = None
        self._reshard_session = WorkerSession(self._reshard_model(), self.vllm_config, RefitSpec.from_dict(refit))

    def reshard_refit(self) -> None:
        session = getattr(self, "_reshard_session", None)
        if session is None:
            raise RuntimeError("call reshard_init before reshard_refit")
        session.start()
        try:
            session.receive()
        finally:
            session.finish()

    def reshard_direct_problems(self, replica: int = 0) -> list[str]:
        """Why this worker's model cannot be written in place (empty list: it can)."""
        spec = spec_of(self.vllm_config)
        layout = declared_layout(spec, self.vllm_config, replica + 1)
        try:
            bind_direct(self._reshard_model(), layout, local_rank(self.vllm_config, replica),
                        representative_layers(spec), self.vllm_config)
        except LayoutMismatchError as e:
            return [f"{type(e).__name__}: {p}" for p in e.problems]
        return []

    def reshard_stats(self) -> dict[str, Any]:
        """This worker's plan-cache counts (compiles, hits) and its rank: a second refit compiles nothing. Callable
        by name through a server's dev route `/collective_rpc` (`{"method": "reshard_stats"}`)."""
        from ...planner import cache

        return {**cache.stats(), "pid": os.getpid()}

    def reshard_close(self) -> None:
        session = getattr(self, "_reshard_session", None)
        if session is not None:
            session.close()
            self._reshard_session = None
