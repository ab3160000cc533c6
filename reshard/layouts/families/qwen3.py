"""Qwen3 dense: GQA attention with per-head q/k RMSNorm, SwiGLU MLP. Every tensor uses a shared role."""
from __future__ import annotations

from typing import Any, ClassVar

from ..family import ModelFamily, attention_layer, dense_mlp
from ..model import ModelSpec


class Qwen3(ModelFamily):
    """Qwen3 dense models: grouped-query attention with per-head q/k norms, a gated MLP."""
    name = "qwen3"
    architectures = ("Qwen3ForCausalLM",)
    model_types = ("qwen3",)
    qk_norm: ClassVar[bool] = True

    def spec(self, config: dict[str, Any], include_mtp: bool = False) -> ModelSpec:
        return ModelSpec(**self._common(config, qk_norm=self.qk_norm))

    def layer(self, spec: ModelSpec, i: int) -> list:
        return attention_layer(spec, dense_mlp(spec))

    def from_megatron(self, config: Any) -> bool:
        return bool(config.qk_layernorm) == self.qk_norm and not config.num_moe_experts
