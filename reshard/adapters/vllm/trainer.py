"""The trainer side of the `reshard` weight-transfer backend (vLLM's `WeightTransferTrainerFactory`).

    info = ReshardTrainerInitInfo.from_refit(refit_spec(spec, src, dst, mode="direct"), rank=0)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=llm_client, source=ReshardSource(src, tensors))
    engine.send_weights()        # every refit: start, update (concurrently with the trainer-side send), finish

Lifecycle:
  1. `trainer_init` (every trainer rank): compile the plan(s) of the refit; on the sender (rank 0) open the
     transport's trainer side and call `client.init_weight_transfer_engine` with the worker payload (the
     RefitSpec plus the plan digest, so a worker that compiles a different plan refuses it).
  2. `send_weights` (every trainer rank): the sender calls `start_weight_update`, then `update_weights` on a
     thread while this process's transport sends its part of the plan, then `finish_weight_update`.
  3. `shutdown`: close the transport's trainer side.
"""
from __future__ import annotations

import abc
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Callable, ClassVar, Mapping, Self

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine, VLLMWeightSyncClient

from ...errors import ExecutionError
from ...layouts import Layout
from ...planner import Plan
from .engine import BACKEND, register
from .session import RefitFields, RefitSpec, plans_digest
from .transport import publish_source, withdraw_source

RankTensors = Mapping[int, Mapping[str, torch.Tensor]]


@dataclass
class ReshardTrainerInitInfo(TrainerInitInfo, RefitFields):
    """The trainer-side init payload: this trainer rank, and a RefitSpec's fields (session.RefitFields); the
    plan digest stays empty (the trainer computes it)."""

    backend: ClassVar[str] = BACKEND

    def refit(self) -> RefitSpec:
        fields = asdict(self)
        fields.pop("rank")
        return RefitSpec(**fields)

    @classmethod
    def from_refit(cls, refit: RefitSpec, rank: int) -> "ReshardTrainerInitInfo":
        fields = asdict(refit)
        fields.pop("plan_digest")  # the trainer computes it
        return cls(rank=rank, **fields)


class ReshardSource:
    """The trainer's tensors in its own layout: source rank -> physical name -> tensor, for the source ranks
    this process plays. (Not a vLLM `WeightSource`: those yield HF-named tensors, and their interface differs
    between vLLM versions; the trainer factory passes `source` through untyped.)"""

    def __init__(self, layout: Layout, tensors: RankTensors):
        self.layout = layout
        self.tensors = tensors


class TrainerTransport(abc.ABC):
    """The sending side of a transport. When `concurrent`, `send` runs while the workers' `update_weights` RPC
    is in flight (both sides of a wire transfer must be posted); otherwise before it."""

    concurrent: ClassVar[bool] = True

    @abc.abstractmethod
    def send(self, plans: list[Plan], source: ReshardSource) -> None: ...

    def close(self) -> None: ...


class InProcessSender(TrainerTransport):
    """The workers read the published source themselves; nothing to send."""

    concurrent = False

    def __init__(self, key: str, source: ReshardSource):
        self.key = key
        publish_source(key, source.tensors)

    def send(self, plans: list[Plan], source: ReshardSource) -> None:
        publish_source(self.key, source.tensors)

    def close(self) -> None:
        withdraw_source(self.key)


_SENDERS: dict[str, Callable[[dict[str, Any], ReshardSource], TrainerTransport]] = {
    "inprocess": lambda options, source: InProcessSender(str(options.get("key", "default")), source),
    # colocated: this process's workers run the executor for both sides inside update_weights
    "distributed": lambda options, source: InProcessSender(str(options.get("key", "default")), source),
}


def register_sender(name: str, factory: Callable[[dict[str, Any], ReshardSource], TrainerTransport]) -> None:
    _SENDERS[name] = factory


class ReshardTrainerWeightTransferEngine(TrainerWeightTransferEngine[ReshardTrainerInitInfo]):
    init_info_cls = ReshardTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: ReshardSource, refit: RefitSpec,
                 is_sender: bool = True, rank: int = 0) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)  # vLLM 0.32 takes no `rank`
        self.rank = rank
        self.refit = refit
        self.plans = refit.plans()
        if refit.transport not in _SENDERS:
            raise ExecutionError(f"no trainer side for transport {refit.transport!r}; registered: {sorted(_SENDERS)}")
        self.sender = _SENDERS[refit.transport](refit.transport_options, source)

    @classmethod
    def trainer_init(cls, init_info: ReshardTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: Any = None) -> Self:
        if not isinstance(source, ReshardSource):
            raise TypeError(f"the reshard backend sends from a ReshardSource (tensors in the trainer's layout), "
                            f"got {type(source).__name__}")
        refit = init_info.refit()
        engine = cls(client=client, source=source, refit=refit, is_sender=init_info.is_sender, rank=init_info.rank)
        if engine.is_sender:
            payload = {**asdict(refit), "plan_digest": plans_digest(engine.plans)}
            client.init_weight_transfer_engine(payload)
        return engine

    def send_weights(self, version: str = "") -> None:
        if not self.is_sender:
            self.sender.send(self.plans, self.source)
            return
        self.client.start_weight_update()
        if not self.sender.concurrent:
            self.sender.send(self.plans, self.source)
            self.client.update_weights({"version": version})
            self.client.finish_weight_update(version or None)
            return
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            future = pool.submit(self.client.update_weights, {"version": version})
            self.sender.send(self.plans, self.source)
            future.result()
        finally:
            pool.shutdown(wait=False)  # a failed send leaves the RPC waiting on a peer that will not come
        self.client.finish_weight_update(version or None)

    def shutdown(self) -> None:
        self.sender.close()


register()  # importing the trainer side makes `reshard` selectable from WeightTransferTrainerFactory


class OfflineLLMClient:
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
