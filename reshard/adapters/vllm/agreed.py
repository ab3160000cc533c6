"""A refit's steps on the workers of one vLLM engine, each agreed on by all of them, however vLLM calls them.

    steps = AgreedSteps(model, vllm_config)
    steps.init(lambda: RefitSpec.from_dict(payload))   # every worker binds; if any fails, none takes part
    steps.start(); steps.update(); steps.finish()
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from ...errors import ExecutionError
from ..refit import RefitSpec
from .session import WorkerSession, transport_timeout

MESSAGE_BYTES = 4096  # per worker, when the workers of an engine tell each other why a step failed
AGREE_TIMEOUT = 300.0  # seconds a worker waits for the others of its engine to agree (the refit's timeout once bound)
log = logging.getLogger("reshard.vllm")


def _engine_group() -> Any:
    """The CPU (gloo) group of every worker of this engine, or None for a single worker."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        group = get_world_group()
    except Exception:  # noqa: BLE001 - not initialized (a bare model in tests): one worker
        return None
    return group.cpu_group if group.world_size > 1 else None


def agreed(step: str, fn: Callable[[], None], timeout: float = AGREE_TIMEOUT, group: Any = None) -> bool:
    """Run `fn` on every worker of this engine and agree on the outcome: True if it succeeded everywhere. Otherwise
    the last worker raises ExecutionError naming every worker's error and the others return False (vLLM's executor
    stops reading answers at the first failure, so a failure on any earlier worker would mix up later calls).
    Waits at most `timeout` seconds for the other workers."""
    from datetime import timedelta

    import torch.distributed as dist

    error = None
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - agreed on below, then raised on the last worker
        error = f"{type(e).__name__}: {e}"
    group = group if group is not None else _engine_group()  # `group`: tests give their own
    if group is None:
        if error is not None:
            raise ExecutionError(f"{step} failed: {error}")
        return True
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    mine = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
    if error is not None:
        data = error.encode()[:MESSAGE_BYTES - 1] or b"?"
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.zeros_like(mine) for _ in range(size)]
    work = dist.all_gather(gathered, mine, group=group, async_op=True)
    try:
        work.wait(timedelta(seconds=timeout))
    except Exception as e:  # noqa: BLE001 - another worker of this engine never came to the agreement
        raise ExecutionError(f"{step}: the other workers of this engine did not agree within {timeout:.0f} s "
                             f"({e}); this worker's own outcome: {error or 'ok'}") from None
    errors = [(r, bytes(t[t.nonzero().flatten()].tolist()).decode(errors="replace"))
              for r, t in enumerate(gathered) if bool(t.any())]
    if not errors:
        return True
    text = "; ".join(f"worker {r}: {m}" for r, m in errors)
    if rank == size - 1:
        raise ExecutionError(f"{step} failed on this engine: {text}")
    log.warning("reshard %s failed on this engine (reported by its last worker): %s", step, text)
    return False


class AgreedSteps:
    """One worker's refit steps, each agreed on by every worker of its engine (see `agreed`)."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any) -> None:
        self.model, self.vllm_config = model, vllm_config
        self.session: WorkerSession | None = None

    def init(self, refit: Callable[[], RefitSpec], check: Callable[[RefitSpec], None] | None = None) -> None:
        """Bind this worker to the refit `refit()` returns (after the caller's `check`), agreed on; the rest of the
        set-up goes on in the background and `start` agrees on its outcome."""
        self.close()

        def init() -> None:
            spec = refit()
            if check is not None:
                check(spec)
            self.session = WorkerSession(self.model, self.vllm_config, spec, background=True)

        if not agreed("init", init) and self.session is not None:
            self.close()  # another worker of this engine failed: none of them takes part

    def active(self) -> WorkerSession:
        """The bound session (RuntimeError before init)."""
        if self.session is None:
            raise RuntimeError("reshard weight transfer is not initialized: init it first")
        return self.session

    def _timeout(self) -> float:
        if self.session is None:
            return AGREE_TIMEOUT
        # another worker may still be inside its own step, bounded by the transport's timeout
        return 2 * transport_timeout(self.session.refit.options, AGREE_TIMEOUT) + 30.0

    def start(self) -> None:
        """Open an update on every worker, agreed on (the background set-up's outcome too)."""
        agreed("start", lambda: self.active().start(), self._timeout())

    def update(self, error: Exception | None = None, phase: str = "all", refit: str = "") -> None:
        """The transfer on every worker, agreed on, and only then the install. `phase`: "transfer" stops before the
        install, "install" installs what this update's transfer received, "all" does both. `refit`: the refit id
        the update belongs to (another is refused). `error`: the update's info was invalid (raised inside the
        agreement)."""

        def transfer() -> None:
            if error is not None:
                raise error
            self.active().check_refit(refit)
            if phase == "install":
                self.active().install()
            else:
                self.active().transfer()

        if agreed("update", transfer, self._timeout()) and phase == "all":
            agreed("install", lambda: self.active().install(), self._timeout())
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def finish(self) -> None:
        """Close the update on this worker (nothing left to do once bound: the install committed it)."""
        self.active()

    def close(self) -> None:
        """Close the session (its transport), if any."""
        if self.session is not None:
            self.session.close()
            self.session = None


__all__ = ["AgreedSteps", "agreed"]
