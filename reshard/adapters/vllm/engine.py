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

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from ..refit import RefitSpec
from .session import WorkerSession

BACKEND = "reshard"


class ReshardInitInfo(WeightTransferInitInfo):
    """The worker-side init payload: a RefitSpec's fields, validated as untrusted input on arrival."""

    def __init__(self, **fields: Any) -> None:
        self.spec = RefitSpec.from_dict(fields)

    def refit(self) -> RefitSpec:
        return self.spec


@dataclass
class ReshardUpdateInfo(WeightTransferUpdateInfo):
    """Per-round info: a free label of the weights being sent (logged by the caller), nothing else needed --
    the plan fixed at init says what moves."""

    version: str = ""


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
        self.session = WorkerSession(self.model, self.vllm_config, init_info.refit())

    def _active(self) -> WorkerSession:
        if self.session is None:
            raise RuntimeError("reshard weight transfer is not initialized: call init_weight_transfer_engine first")
        return self.session

    def start_weight_update(self) -> None:
        self._active().start()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: ReshardUpdateInfo) -> None:
        self._active().receive()

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
