"""A vLLM worker extension for refits driven by `collective_rpc` (stacks that call worker methods directly, and
in-slot LoRA refits, which the weight-transfer API cannot carry), e.g.

    llm = LLM(model=..., worker_extension_cls="reshard.adapters.vllm.worker.ReshardWorkerExtension")
    llm.collective_rpc("reshard_init", args=(refit.to_dict(),))        # a RefitSpec; raises before bytes move
    llm.collective_rpc("reshard_refit")                                 # start, update, finish

Each step is also a method of its own, so a trainer can send while the workers receive
(`reshard.adapters.server.ExtensionClient`, over a server's `/collective_rpc`, passes arguments as JSON text).
Importing this module registers the `reshard` weight-transfer engine in the worker process.
"""
from __future__ import annotations

import json
import os
from typing import Any

from ...errors import LayoutMismatchError, PlanError
from ...planner import cache
from ..refit import RefitSpec
from .session import AgreedSteps
from .derive import representative_layers
from .direct import bind_direct
from .engine import ReshardUpdateInfo, register
from .experts import live_placement
from .live import declared_layout, local_rank, parallel_sizes, spec_of

register()


def _json(value: Any, what: str) -> Any:
    """A step's argument: the value, or the JSON text of it (the HTTP route passes strings only)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as e:
        raise PlanError(f"{what} is not JSON: {e}") from None


class ReshardWorkerExtension:
    """Mixed into vLLM's worker class: `self` is the worker (model_runner, vllm_config)."""

    def _reshard_model(self) -> Any:
        return self.model_runner.get_model()

    def _reshard_steps(self) -> AgreedSteps:
        steps = getattr(self, "_reshard_agreed", None)
        if steps is None:
            steps = self._reshard_agreed = AgreedSteps(self._reshard_model(), self.vllm_config)
        return steps

    def reshard_init(self, refit: dict[str, Any] | str) -> None:
        """Bind this worker to a refit (a RefitSpec, or its JSON), agreed on by every worker of the engine."""
        self._reshard_steps().init(lambda: RefitSpec.from_dict(_json(refit, "the refit spec")))

    def reshard_start(self) -> None:
        """Open an update on every worker, agreed on."""
        self._reshard_steps().start()

    def reshard_update(self, update_info: dict[str, Any] | str = "") -> None:
        """One phase of the update (its info, or its JSON; empty: transfer and install)."""
        try:  # a bad update_info is refused inside the agreement, as every worker's error is
            info = _json(update_info, "update_info") if update_info else {}
            if not isinstance(info, dict):
                raise PlanError(f"update_info must be a JSON object, got {type(info).__name__}")
            parsed = ReshardUpdateInfo(**info)
            error, phase, refit = parsed.error, parsed.phase, parsed.refit
        except (PlanError, TypeError) as e:
            error, phase, refit = (e if isinstance(e, PlanError) else PlanError(f"update_info: {e}")), "all", ""
        self._reshard_steps().update(error, phase, refit)

    def reshard_finish(self) -> None:
        """Close the update."""
        self._reshard_steps().finish()

    def reshard_refit(self) -> None:
        """start, update, finish: one refit (the trainer sends at the same time)."""
        self.reshard_start()
        self.reshard_update()
        self.reshard_finish()

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

    def reshard_expert_placement(self) -> dict[str, Any] | None:
        """The expert placement this engine's EPLB state holds now, as JSON (None without EPLB): what a trainer
        follows after a rebalance (`refit.with_expert_placement`).

        Raises:
            ArgumentError: the EPLB state's maps are not a placement.
        """
        tp, _ = parallel_sizes(self.vllm_config)
        placement = live_placement(self._reshard_model(), tp)
        return None if placement is None else placement.model_dump(mode="json")

    def reshard_stats(self) -> dict[str, Any]:
        """This worker's plan-cache counts, its pid and, once a refit installed, its last install's time (`flip_s`),
        its wait for a staged transfer (`tail_s`) and whether its flip swaps a shadow in (`swap`)."""
        session = self._reshard_session()
        times = {"flip_s": session.flip_s, "tail_s": session.tail_s,
                 "swap": session.shadow is not None} if session else {}
        return {**cache.stats(), "pid": os.getpid(), **times}

    def _reshard_session(self) -> Any:
        """This worker's refit session: the weight-transfer engine's, else this extension's (None: neither)."""
        engine = getattr(getattr(self, "weight_transfer_engine", None), "steps", None)
        return next((s.session for s in (engine, getattr(self, "_reshard_agreed", None)) if s and s.session), None)

    def reshard_landed(self) -> dict[str, Any]:
        """`WorkerSession.landed` of this worker's last refit (weight-transfer API or this extension)."""
        session = self._reshard_session()
        if session is None:
            raise PlanError("no refit session on this worker: nothing landed yet")
        return session.landed()

    def reshard_staged(self) -> dict[str, Any]:
        """`WorkerSession.staged`: whether this worker's staged transfer has ended ({"done", "error"})."""
        session = self._reshard_session()
        return session.staged() if session else {"done": True, "error": "no refit session on this worker"}

    def reshard_in_flight(self) -> list[str]:
        """The ids of the requests this worker holds state for (running, or frozen by a "keep" pause)."""
        return sorted(self.model_runner.requests)

    def reshard_close(self) -> None:
        """Close this worker's refit session."""
        self._reshard_steps().close()
