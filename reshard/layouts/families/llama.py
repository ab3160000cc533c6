"""Llama: Qwen3's layer without the q/k norms (the spec's qk_norm is False)."""
from __future__ import annotations

from typing import Any

from ..model import ModelSpec
from . import ModelFamily, decoder
from .qwen3 import dense_layer


class Llama(ModelFamily):
    name = "llama"
    architectures = ("LlamaForCausalLM",)
    model_types = ("llama",)

    def spec(self, config: dict[str, Any], include_mtp: bool = False) -> ModelSpec:
        return ModelSpec(**self._common(config, qk_norm=False))

    def tensors(self, spec: ModelSpec) -> list:
        return decoder(spec, dense_layer)
