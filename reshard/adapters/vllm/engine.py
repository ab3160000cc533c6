"""The `reshard` weight-transfer engine, selected by vLLM's weight-transfer API with
`weight_transfer_config={"backend": "reshard"}`. `register()` runs in every worker through the `vllm.general_plugins`
entry point or on import of the worker extension. Each call of vLLM's protocol (init, start, update, finish,
shutdown) is one agreed step of `session.AgreedSteps`.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from ...errors import PlanError
from ..refit import RefitSpec
from .session import AgreedSteps

BACKEND = "reshard"


class ReshardInitInfo(WeightTransferInitInfo):
    """The worker-side init payload, a RefitSpec's fields; never raises itself (vLLM parses it before the workers
    can agree on failures): they are parsed by `refit()`, inside the engine's agreement."""

    def __init__(self, **fields: Any) -> None:
        self.fields = fields

    def refit(self) -> RefitSpec:
        """The parsed RefitSpec; raises what parsing it raises."""
        return RefitSpec.from_dict(self.fields)


PHASES = ("transfer", "install", "all")


class ReshardUpdateInfo(WeightTransferUpdateInfo):
    """Per-update info: the version label, the refit id it belongs to (another is refused) and the phase:
    "transfer" (the model untouched), "install" (the flip) or "all". Never raises itself (see ReshardInitInfo)."""

    def __init__(self, version: str = "", refit: str = "", phase: str = "all", **unknown: Any) -> None:
        self.version, self.refit, self.phase = str(version), str(refit), str(phase)
        self.error = PlanError(f"update_info has unknown fields {sorted(unknown)}; known: ['phase', 'refit', "
                               f"'version']") if unknown else None
        if self.error is None and self.phase not in PHASES:
            self.error = PlanError(f"update_info phase={phase!r} is not one of {PHASES}")


class ReshardWeightTransferEngine(WeightTransferEngine[ReshardInitInfo, ReshardUpdateInfo]):
    """vLLM's worker-side weight-transfer engine `reshard`: each protocol call is one step of `AgreedSteps`."""
    init_info_cls = ReshardInitInfo
    update_info_cls = ReshardUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.steps = AgreedSteps(model, vllm_config)

    def init_transfer_engine(self, init_info: ReshardInitInfo) -> None:
        self.steps.init(init_info.refit, _full_weights_only)

    def start_weight_update(self) -> None:
        self.steps.start()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: ReshardUpdateInfo) -> None:
        self.steps.update(update_info.error, update_info.phase, update_info.refit)

    def finish_weight_update(self) -> None:
        self.steps.finish()

    def shutdown(self) -> None:
        self.steps.close()


def _full_weights_only(refit: RefitSpec) -> None:
    """Refuse an in-slot LoRA refit: vLLM's weight-transfer API drops every loaded adapter when an update finishes."""
    if refit.install == "lora_slot":
        raise PlanError("install='lora_slot' cannot go through vLLM's weight-transfer API: vLLM drops every loaded "
                        "LoRA adapter when a weight update finishes (reset_lora_state). Refit adapters through the "
                        "reshard worker extension (--worker-extension-cls reshard.adapters.vllm.worker."
                        "ReshardWorkerExtension; trainer side: reshard.adapters.server.ExtensionClient)")


def register() -> None:
    """Register the worker and trainer engines under `reshard` in this process (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, module, cls in ((WeightTransferEngineFactory, __name__, "ReshardWeightTransferEngine"),
                                 (WeightTransferTrainerFactory, "reshard.adapters.vllm.trainer",
                                  "ReshardTrainerWeightTransferEngine")):
        with contextlib.suppress(ValueError):  # already registered in this process
            factory.register_engine(BACKEND, module, cls)
