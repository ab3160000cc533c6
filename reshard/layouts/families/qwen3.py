"""Qwen3 dense: GQA attention with per-head q/k RMSNorm, SwiGLU MLP. Every tensor uses a shared role."""
from __future__ import annotations

from typing import Any, Callable

from ..model import ModelSpec, Role
from . import ModelFamily, decoder, dense_mlp, gqa_attention, norm


def layer(spec: ModelSpec, i: int, mlp: Callable[[ModelSpec, int], list] = dense_mlp) -> list:
    """Norm, GQA attention, norm, then `mlp`'s tensors (a dense SwiGLU MLP unless another is given)."""
    H = spec.hidden_size
    return [norm(i, "input_layernorm.weight", H, Role.INPUT_NORM), *gqa_attention(spec, i),
            norm(i, "post_attention_layernorm.weight", H, Role.POST_ATTN_NORM), *mlp(spec, i)]


def dense_layer(spec: ModelSpec, i: int) -> list:
    return layer(spec, i)


class Qwen3(ModelFamily):
    name = "qwen3"
    architectures = ("Qwen3ForCausalLM",)
    model_types = ("qwen3",)

    def spec(self, config: dict[str, Any], include_mtp: bool = False) -> ModelSpec:
        return ModelSpec(**self._common(config, qk_norm=True))

    def tensors(self, spec: ModelSpec) -> list:
        return decoder(spec, dense_layer)
