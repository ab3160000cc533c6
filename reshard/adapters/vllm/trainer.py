"""The `reshard` backend of vLLM's trainer-side weight-transfer API (`WeightTransferTrainerFactory`): a shell around
`adapters.trainer.TrainerSession`, which trainers that must not import vLLM use directly.

    info = ReshardTrainerInitInfo(refit=RefitSpec.of(spec, src, dst, transport="collective").to_dict(), rank=r)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client if r == 0 else None, source=tensors)
    engine.send_weights(version="step-3")   # every trainer rank, every refit
    engine.shutdown()
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine, VLLMWeightSyncClient

from ..engines import EngineClient
from ..refit import RefitSpec
from ..trainer import TrainerSession
from .engine import BACKEND, register


@dataclass
class ReshardTrainerInitInfo(TrainerInitInfo):
    """This trainer rank (`rank`) and the refit (a RefitSpec as JSON)."""

    backend: ClassVar[str] = BACKEND
    refit: dict[str, Any] = field(default_factory=dict)


class ReshardTrainerWeightTransferEngine(TrainerWeightTransferEngine[ReshardTrainerInitInfo]):
    """vLLM's trainer-side weight-transfer engine `reshard`: one `TrainerSession` per trainer rank (rank 0 drives the
    engine through `client`); `send_weights` is one refit of this rank's tensors in the trainer's layout."""
    init_info_cls = ReshardTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient | None, source: Any, session: TrainerSession,
                 is_sender: bool) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.session = session

    @classmethod
    def trainer_init(cls, init_info: ReshardTrainerInitInfo, *, client: VLLMWeightSyncClient | None = None,
                     source: Any = None) -> "ReshardTrainerWeightTransferEngine":
        if not isinstance(source, dict):
            raise TypeError(f"the reshard backend sends this rank's tensors in the trainer's layout ({{name: tensor}} "
                            f"or {{source rank: {{name: tensor}}}}), got {type(source).__name__}")
        rank = init_info.rank
        engines = [client] if rank == 0 and client is not None else []
        session = TrainerSession(RefitSpec.from_dict(init_info.refit), rank, source, engines=engines)
        session.init()
        return cls(client=client, source=source, session=session, is_sender=rank == 0)

    def send_weights(self, version: str = "") -> None:
        self.session.refit(version or None)

    def shutdown(self) -> None:
        self.session.close()


register()  # importing the trainer side makes `reshard` selectable from WeightTransferTrainerFactory


class OfflineLLMClient(EngineClient):
    """`VLLMWeightSyncClient` over an in-process `vllm.LLM` (its RL methods take request dicts)."""

    def __init__(self, llm: Any):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)
