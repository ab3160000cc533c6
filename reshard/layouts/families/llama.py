"""Llama: Qwen3's layer without the q/k norms (the spec's qk_norm is False)."""
from __future__ import annotations

from typing import Any

from ..family import ModelFamily, attention_layer, dense_mlp
from ..model import ModelSpec


class Llama(ModelFamily):
    """Llama models: grouped-query attention without q/k norms, a gated MLP."""
    name = "llama"
    architectures = ("LlamaForCausalLM",)
    model_types = ("llama",)

    def spec(self, config: dict[str, Any], include_mtp: bool = False) -> ModelSpec:
        return ModelSpec(**self._common(config, qk_norm=False))

    def layer(self, spec: ModelSpec, i: int) -> list:
        return attention_layer(spec, dense_mlp(spec))

    def from_megatron(self, config: Any) -> bool:
        return not config.qk_layernorm and not config.num_moe_experts
