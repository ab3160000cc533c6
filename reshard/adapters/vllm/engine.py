"""The `reshard` weight-transfer engine: vLLM's weight-transfer API (NeMo-RL, ART, any stack using it) selects
it with `weight_transfer_config={"backend": "reshard"}`.

Registration is per process: `register()` runs in every vLLM worker through the `vllm.general_plugins` entry
point (pyproject.toml) or on import of the worker extension (`worker_extension_cls=
"reshard.adapters.vllm.worker.ReshardWorkerExtension"`).

Lifecycle, per worker (vLLM makes the calls; session.py says what each step checks):
  1. vLLM builds the engine after loading the model: `ReshardWeightTransferEngine(config, vllm_config, device,
     model)`.
  2. `init_weight_transfer_engine(init_info)`: the init info is a `RefitSpec` as JSON (adapters.refit); the
     worker's `WorkerSession` checks it against this engine, compiles the plan, binds the destination and opens
     the transport; anything wrong raises here, before a byte moves.
  3. `start_weight_update()`, `update_weights(update_info)` (the transport runs this worker's part of the plan,
     then the bytes are installed), `finish_weight_update()`: one refit, all or nothing on this engine.
  4. `shutdown()`: close the transport.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from ...errors import ExecutionError, PlanError
from ..refit import RefitSpec
from .session import WorkerSession

BACKEND = "reshard"
MESSAGE_BYTES = 4096  # per worker, when the workers of an engine tell each other why a step failed
log = logging.getLogger("reshard.vllm")


class ReshardInitInfo(WeightTransferInitInfo):
    """The worker-side init payload: a RefitSpec's fields, validated as untrusted input. Never raises itself
    (vLLM parses it on every worker before the engine can agree on failures): `refit()` raises."""

    def __init__(self, **fields: Any) -> None:
        self.spec: RefitSpec | None = None
        self.error: Exception | None = None
        try:
            self.spec = RefitSpec.from_dict(fields)
        except Exception as e:  # noqa: BLE001 - raised by refit(), inside the engine's agreement
            self.error = e

    def refit(self) -> RefitSpec:
        if self.spec is None:
            raise self.error
        return self.spec


class ReshardUpdateInfo(WeightTransferUpdateInfo):
    """Per-round info: the version label of the weights being sent, nothing else -- the plan fixed at init says
    what moves. Never raises itself (see ReshardInitInfo)."""

    def __init__(self, version: str = "", **unknown: Any) -> None:
        self.version = str(version)
        self.error = PlanError(f"update_info has unknown fields {sorted(unknown)}; known: ['version']") \
            if unknown else None


def _engine_group() -> Any:
    """The CPU (gloo) group of every worker of this engine, or None for a single worker."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        group = get_world_group()
    except Exception:  # noqa: BLE001 - not initialized (a bare model in tests): one worker
        return None
    return group.cpu_group if group.world_size > 1 else None


def agreed(step: str, fn: Callable[[], None]) -> bool:
    """Run `fn` on every worker of this engine and agree on the outcome: True if it succeeded everywhere. If it
    failed anywhere, the engine's last worker raises ExecutionError naming every worker's error and the others
    return False. Why only the last: vLLM's multiprocess executor (0.32, 0.33) reads workers' answers in rank
    order and stops at the first failure, leaving the later workers' answers to be read by the next call, which
    mixes up every later call's answers; a failure on the last worker alone leaves nothing unread."""
    import torch.distributed as dist

    error = None
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - agreed on below, then raised on the last worker
        error = f"{type(e).__name__}: {e}"
    group = _engine_group()
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
    dist.all_gather(gathered, mine, group=group)
    errors = [(r, bytes(t[t.nonzero().flatten()].tolist()).decode(errors="replace"))
              for r, t in enumerate(gathered) if bool(t.any())]
    if not errors:
        return True
    text = "; ".join(f"worker {r}: {m}" for r, m in errors)
    if rank == size - 1:
        raise ExecutionError(f"{step} failed on this engine: {text}")
    log.warning("reshard %s failed on this engine (reported by its last worker): %s", step, text)
    return False


class ReshardWeightTransferEngine(WeightTransferEngine[ReshardInitInfo, ReshardUpdateInfo]):
    init_info_cls = ReshardInitInfo
    update_info_cls = ReshardUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.session: WorkerSession | None = None

    def init_transfer_engine(self, init_info: ReshardInitInfo) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None

        def init() -> None:
            self.session = WorkerSession(self.model, self.vllm_config, init_info.refit())

        if not agreed("init", init) and self.session is not None:
            self.session.close()  # another worker of this engine failed: none of them takes part
            self.session = None

    def _active(self) -> WorkerSession:
        if self.session is None:
            raise RuntimeError("reshard weight transfer is not initialized: call init_weight_transfer_engine first")
        return self.session

    def start_weight_update(self) -> None:
        agreed("start", lambda: self._active().start())

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: ReshardUpdateInfo) -> None:
        """The transfer on every worker, agreed on; only then the install (nothing is installed anywhere if any
        worker lacks its bytes)."""

        def transfer() -> None:
            if update_info.error is not None:
                raise update_info.error
            self._active().transfer()

        if agreed("update", transfer):
            agreed("install", lambda: self._active().install())

    def finish_weight_update(self) -> None:
        self._active().finish()

    def shutdown(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


def register() -> None:
    """Register the worker and trainer engines under `reshard` in this process (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, module, cls in ((WeightTransferEngineFactory, __name__, "ReshardWeightTransferEngine"),
                                 (WeightTransferTrainerFactory, "reshard.adapters.vllm.trainer",
                                  "ReshardTrainerWeightTransferEngine")):
        try:
            factory.register_engine(BACKEND, module, cls)
        except ValueError:  # already registered in this process
            pass
