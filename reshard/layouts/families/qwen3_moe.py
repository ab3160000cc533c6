"""Qwen3-MoE: Qwen3 attention; sparse layers hold a router and routed experts (no shared expert), the layers
in `mlp_only_layers` or off the `decoder_sparse_step` grid a dense MLP."""
from __future__ import annotations

from typing import Any

from ...limits import MAX_EXPERTS, MAX_LAYERS
from ..family import ModelFamily, attention_layer, dense_mlp, routed_experts
from ..hf_config import get_int, get_int_list
from ..model import ModelSpec


class Qwen3Moe(ModelFamily):
    """Qwen3 mixture-of-experts models: Qwen3's attention, routed experts without a shared one."""
    name = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)
    model_types = ("qwen3_moe",)

    def spec(self, config: dict[str, Any], include_mtp: bool = False) -> ModelSpec:
        key = "num_experts" if "num_experts" in config or "num_local_experts" not in config else "num_local_experts"
        # transformers 5 saves num_local_experts; both engines build a dense MLP everywhere with 0 experts,
        # which is a Qwen3 dense model: refused here, so that a MoE config never silently loses its experts
        experts = get_int(config, key, maximum=MAX_EXPERTS, what="experts")
        fields = self._common(config, qk_norm=True)
        layers = fields["num_layers"]
        step = get_int(config, "decoder_sparse_step", 1, maximum=MAX_LAYERS, null_is_default=True, what="layers")
        mlp_only = set(get_int_list(config, "mlp_only_layers", below=layers))
        # HF Qwen3-MoE: layer i is sparse iff i not in mlp_only_layers and (i + 1) % step == 0.
        dense = tuple(i for i in range(layers) if i in mlp_only or (i + 1) % step != 0)
        return ModelSpec(**fields, num_experts=experts,
                         moe_intermediate_size=get_int(config, "moe_intermediate_size"), dense_layers=dense)

    def layer(self, spec: ModelSpec, i: int) -> list:
        return attention_layer(spec, routed_experts(spec) if spec.is_moe_layer(i) else dense_mlp(spec))

    def from_megatron(self, config: Any) -> bool:
        return bool(config.qk_layernorm) and bool(config.num_moe_experts)
