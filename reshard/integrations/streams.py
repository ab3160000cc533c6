"""What an exporter's stream of (name, tensor) may hold, mapped onto the model's HF tensors: one rule for both
integrations (verl's `send_weights`, NeMo-RL's `send_weights`).

Exporters do not all stream a checkpoint's HF names: transformers 5 state dicts fuse MoE experts into 3-D tensors,
NeMo-RL adds FP8 KV-cache scales and Eagle/MTP draft tensors when those features are on. `StreamNames.split` maps
one stream item onto the model's own HF tensors (what the plan was compiled for), declares extras it skips, and
refuses anything else with an error naming it.

(Skeleton: plain HF names pass through; everything else is refused. Fused experts and declared extras are being
added.)
"""
from __future__ import annotations

from typing import Any

import torch

from ..errors import ArgumentError
from ..layouts import ModelSpec


class StreamNames:
    """The names a stream may carry for one model.

    Args:
        spec: the model the plan was compiled for.
    """

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self._names = {t.name for t in spec.tensors}

    def split(self, name: Any, tensor: Any) -> list[tuple[str, torch.Tensor]]:
        """The model's HF tensors one stream item carries.

        Returns:
            [(name, tensor)] for one of the model's HF names (its shape and dtype are the caller's to check);
            the per-expert tensors (views, no copy) for a fused expert tensor; [] for a declared extra the plan
            does not carry (logged once per name).
        Raises:
            ArgumentError: a name that is none of these, or a fused tensor of the wrong shape.
        """
        if isinstance(name, str) and name in self._names:
            return [(name, tensor)]
        raise ArgumentError("weights", name, f"is not a tensor of the {self.spec.family} model the plan was "
                            f"compiled for", fix="stream the model's HF names")


__all__ = ["StreamNames"]
