"""Qwen3-MoE: Qwen3 attention; sparse layers hold a router and routed experts (no shared expert), the layers
in `mlp_only_layers` or off the `decoder_sparse_step` grid a dense MLP."""
from __future__ import annotations

from typing import Any

from ..family import ModelFamily, attention_layer, dense_mlp, routed_experts
from ..model import ModelSpec


class Qwen3Moe(ModelFamily):
    name = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)
    model_types = ("qwen3_moe",)

    def spec(self, config: dict[str, Any], include_mtp: bool = False) -> ModelSpec:
        if "num_experts" not in config and "num_local_experts" in config:
            config = {**config, "num_experts": config["num_local_experts"]}  # transformers 5 saves this name
        self._require(config, "num_experts", "moe_intermediate_size")
        fields = self._common(config, qk_norm=True)
        layers = fields["num_layers"]
        step = config.get("decoder_sparse_step", 1) or 1
        mlp_only = set(config.get("mlp_only_layers") or ())
        # HF Qwen3-MoE: layer i is sparse iff i not in mlp_only_layers and (i + 1) % step == 0.
        dense = tuple(i for i in range(layers) if i in mlp_only or (i + 1) % step != 0)
        return ModelSpec(**fields, num_experts=config["num_experts"],
                         moe_intermediate_size=config["moe_intermediate_size"], dense_layers=dense)

    def layer(self, spec: ModelSpec, i: int) -> list:
        return attention_layer(spec, routed_experts(spec) if spec.is_moe_layer(i) else dense_mlp(spec))

    def from_megatron(self, config: Any) -> bool:
        return bool(config.qk_layernorm) and bool(config.num_moe_experts)
