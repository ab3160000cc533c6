"""Qwen3-MoE: Qwen3 attention; sparse layers hold a router and routed experts (no shared expert), the layers
in `mlp_only_layers` or off the `decoder_sparse_step` grid a dense MLP."""
from __future__ import annotations

from typing import Any

from ..model import ModelSpec
from . import ModelFamily, decoder, dense_mlp, routed_experts
from .qwen3 import layer


def _layer(spec: ModelSpec, i: int) -> list:
    return layer(spec, i, routed_experts if spec.is_moe_layer(i) else dense_mlp)


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

    def tensors(self, spec: ModelSpec) -> list:
        return decoder(spec, _layer)
