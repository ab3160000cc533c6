"""The HF layout: every canonical tensor whole, under its checkpoint name, on each replica's single rank."""
from __future__ import annotations

from typing import Sequence

import numpy as np
from pydantic import StrictInt, model_validator

from .base import Layout, Placement, PlacementTable, TableBuilder, WholePerReplica
from .model import TensorSpec


class HfLayout(WholePerReplica, Layout):
    """An HF checkpoint's layout: every canonical tensor whole, under its checkpoint name, on one rank a replica.

    Args:
        model: the model whose tensors the layout holds.
        replicas: identical copies (replica k is rank k).

    Raises:
        LayoutError: `replicas` is not a positive int within `reshard.limits`.
    """

    engine = "hf"

    replicas: StrictInt = 1

    @model_validator(mode="after")
    def _validate(self) -> "HfLayout":
        self._check_replicas()
        return self

    def placements(self, tensor: TensorSpec, replica: int | None = None) -> list[Placement]:
        zero = (0,) * len(tensor.shape)
        replicas = range(self.replicas) if replica is None else (replica,)
        return [Placement(k, tensor.name, tensor.shape, zero, tensor.shape, zero) for k in replicas]

    def placement_table(self, index: np.ndarray | Sequence[int] | None = None,
                        replica: int | None = None) -> PlacementTable:
        c = self.model.canonical
        index = np.arange(len(c), dtype=np.int64) if index is None else np.asarray(index, dtype=np.int64)
        b = TableBuilder()
        kind = np.asarray([b.kind(self.model.tensor_name(k), c.entries[int(c.entry[k])].shape) for k in index.tolist()],
                          dtype=np.int64)
        ranks = np.arange(self.replicas) if replica is None else np.asarray([replica])
        b.add(index[:, None], ranks[None, :], kind[:, None], 0, 0, c.rows[index][:, None], c.cols[index][:, None],
              0, c.cols[index][:, None])
        return b.table()
