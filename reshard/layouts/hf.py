"""The HF layout: every canonical tensor whole, under its checkpoint name, on each replica's single rank."""
from __future__ import annotations

from .base import Layout, Placement, positive
from .model import TensorSpec

from pydantic import model_validator


class HfLayout(Layout):
    kind = "hf"

    replicas: int = 1

    @model_validator(mode="after")
    def _validate(self) -> "HfLayout":
        positive(self, replicas=self.replicas)
        return self

    @property
    def num_ranks(self) -> int:
        return self.replicas

    @property
    def num_replicas(self) -> int:
        return self.replicas

    def __str__(self) -> str:
        return f"hf:replicas={self.replicas}"

    def placements(self, tensor: TensorSpec, replica: int | None = None) -> list[Placement]:
        zero = (0,) * len(tensor.shape)
        replicas = range(self.replicas) if replica is None else (replica,)
        return [Placement(k, tensor.name, tensor.shape, zero, tensor.shape, zero) for k in replicas]

    def rank_tensors(self, rank: int) -> dict[str, tuple[int, ...]]:
        self._check_rank(rank)
        return {t.name: t.shape for t in self.model.tensors}
