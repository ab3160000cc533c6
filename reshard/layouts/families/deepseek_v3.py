"""DeepSeek-V3 and Kimi-K2 (`DeepseekV3ForCausalLM`): multi-head latent attention, the first
`first_k_dense_replace` layers dense, the others a router (+ float32 e_score_correction_bias), routed and
shared experts. Multi-token-prediction layers are left out of refits.

Sources: transformers' modeling_deepseek_v3.py, megatron-core's multi_latent_attention.py and gpt_layer_specs.py,
vLLM's deepseek_v2.py (versions: docs/guides/layouts.md). q_a_proj / kv_a_proj_with_mqa are TP row blocks of
linear_q/kv_down_proj under local naming, whole under TE, whole rows of vLLM's fused_qkv_a_proj (its own
kv_a_proj_with_mqa without q LoRA); q_b_proj / q_proj / kv_b_proj are TP row blocks everywhere (head-major rows,
so blocks are whole heads); TE fuses the q/kv a-layernorms into linear_q/kv_up_proj. The router bias is Megatron's
`mlp.router.expert_bias`; shared experts are split like a dense MLP. `mla_down_proj_fusion` is not declared."""
from __future__ import annotations

from typing import Any

from ...errors import ModelConfigError
from ...limits import MAX_DIM, MAX_EXPERTS, MAX_LAYERS, check_limit
from ..cuts import Replicated, RowBlocks, TensorKind
from ..family import LAYER, ModelFamily, StreamExtra, dense_mlp, gated_mlp_entries, norm, routed_experts
from ..hf_config import get_int, get_str
from ..model import Entry, ModelSpec, Role
from ..roles import gated_mlp, tensor_kind

_A = LAYER + "self_attn."
_M = LAYER + "mlp."

INPUT_NORM = tensor_kind("mla_input_norm",
                         Replicated("input_layernorm.weight"), Replicated(LAYER + "input_layernorm.weight"))
Q_FULL = tensor_kind("mla_q",
                     RowBlocks("self_attention.linear_q_proj.weight"), RowBlocks(_A + "q_proj.weight"), linear=True)


def _up(x: str) -> tuple[TensorKind, TensorKind]:
    """The a-layernorm and up projection of the q or kv low-rank path (TE fuses the norm into linear_{x}_up_proj)."""
    up = f"self_attention.linear_{x}_up_proj."
    return (tensor_kind(f"mla_{x}_norm", Replicated(f"self_attention.{x}_layernorm.weight"),
                        Replicated(f"{_A}{x}_a_layernorm.weight"), te=Replicated(up + "layer_norm_weight")),
            tensor_kind(f"mla_{x}_up", RowBlocks(up + "weight"), RowBlocks(f"{_A}{x}_b_proj.weight"), linear=True))


(Q_NORM, Q_UP), (KV_NORM, KV_UP) = _up("q"), _up("kv")
ROUTER_BIAS = tensor_kind("router_bias",
                          Replicated("mlp.router.expert_bias"), Replicated(_M + "gate.e_score_correction_bias"))
SHARED_MLP = gated_mlp("mlp.shared_experts.", _M + "shared_experts.", "shared_expert_")


def _down_kinds(q_rank: int | None, kv_rows: int) -> tuple[TensorKind | None, TensorKind]:
    """q_a_proj / kv_a_proj_with_mqa's kinds (q_a_proj's None without q LoRA)."""

    def down(x: str, vllm: Replicated) -> TensorKind:  # TP row blocks under local naming, whole under TE
        name = f"self_attention.linear_{x}_down_proj.weight"
        return tensor_kind(f"mla_{x}_down", RowBlocks(name), vllm, te=Replicated(name), linear=True)

    if q_rank is None:
        return None, down("kv", Replicated(_A + "kv_a_proj_with_mqa.weight"))
    fused = _A + "fused_qkv_a_proj.weight"
    return (down("q", Replicated(fused, 0, q_rank + kv_rows)), down("kv", Replicated(fused, q_rank, q_rank + kv_rows)))


class DeepseekV3(ModelFamily):
    """DeepSeek-V3 and Kimi-K2: multi-latent attention, dense first layers, routed and shared experts."""
    name = "deepseek_v3"
    architectures = ("DeepseekV3ForCausalLM",)
    model_types = ("deepseek_v3", "kimi_k2")
    megatron_config_class = "MLATransformerConfig"
    fp8_router = False  # vLLM builds DeepSeek's gate without quant_config; the FP8 release keeps it in bf16

    def spec(self, config: dict[str, Any], include_mtp: bool = False) -> ModelSpec:
        self._refuse_mtp(config, include_mtp, "num_nextn_predict_layers", "model.layers.N.* past the last")
        fields = self._common(config, qk_norm=False, biases=("attention_bias",))
        mla = {k: get_int(config, k) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
        fields["head_dim"] = mla["v_head_dim"]  # unused by MLA tensors; keeps the shared checks meaningful
        layers = fields["num_layers"]
        first_dense = get_int(config, "first_k_dense_replace", 0, minimum=0, maximum=MAX_LAYERS,
                              null_is_default=True, what="layers")
        freq = get_int(config, "moe_layer_freq", 1, maximum=MAX_LAYERS, null_is_default=True, what="layers")
        if freq != 1:  # transformers ignores it, vLLM does not
            raise ModelConfigError(field="moe_layer_freq", value=freq, rule="is not supported (transformers and "
                                   "vLLM disagree on which layers are MoE); only 1")
        # vLLM builds a MoE layer (with no experts, which fails) wherever n_routed_experts is not null
        E = get_int(config, "n_routed_experts", maximum=MAX_EXPERTS, what="experts")
        Fm = get_int(config, "moe_intermediate_size")
        shared = get_int(config, "n_shared_experts", 0, minimum=0, maximum=MAX_EXPERTS, null_is_default=True,
                         what="experts") * Fm
        check_limit("n_shared_experts * moe_intermediate_size", shared, MAX_DIM, "a dimension", "model config")
        topk = get_str(config, "topk_method", None, null_is_default=True)
        if topk is None:
            raise ModelConfigError(field="topk_method", rule=(
                "is missing, and the engines disagree without it: transformers' DeepseekV3 always holds a router "
                "e_score_correction_bias, vLLM only when topk_method is \"noaux_tc\""), fix=(
                "set topk_method to \"noaux_tc\" (DeepSeek-V3 and Kimi-K2 checkpoints, which hold the bias); "
                "transformers' DeepseekV3Config does not write this key"))
        if topk != "noaux_tc":
            raise ModelConfigError(field="topk_method", value=topk, rule=(
                "is not supported: transformers' DeepseekV3 holds a router e_score_correction_bias whatever the "
                "method, vLLM only with \"noaux_tc\", so the two load different tensors"),
                fix="use \"noaux_tc\"")
        return ModelSpec(**fields, num_experts=E, moe_intermediate_size=Fm,
                         dense_layers=tuple(range(min(first_dense, layers))),
                         arch={"q_lora_rank": get_int(config, "q_lora_rank", None, null_is_default=True), **mla,
                               "shared_intermediate_size": shared, "router_bias": True})

    def layer(self, spec: ModelSpec, i: int) -> list:
        a = dict(spec.arch)
        H, n, qr, kr = spec.hidden_size, spec.num_attention_heads, a["q_lora_rank"], a["kv_lora_rank"]
        dn, dr, dv = a["qk_nope_head_dim"], a["qk_rope_head_dim"], a["v_head_dim"]
        q_down, kv_down = _down_kinds(qr, kr + dr)
        out = [norm("input_layernorm.weight", H, INPUT_NORM)]
        if qr is None:
            out.append(Entry(_A + "q_proj.weight", (n * (dn + dr), H), Q_FULL))
        else:
            out += [Entry(_A + "q_a_proj.weight", (qr, H), q_down), Entry(_A + "q_a_layernorm.weight", (qr,), Q_NORM),
                    Entry(_A + "q_b_proj.weight", (n * (dn + dr), qr), Q_UP)]
        out += [Entry(_A + "kv_a_proj_with_mqa.weight", (kr + dr, H), kv_down),
                Entry(_A + "kv_a_layernorm.weight", (kr,), KV_NORM),
                Entry(_A + "kv_b_proj.weight", (n * (dn + dv), kr), KV_UP),
                Entry(_A + "o_proj.weight", (H, n * dv), Role.O),
                norm("post_attention_layernorm.weight", H, Role.POST_ATTN_NORM)]
        if not spec.is_moe_layer(i):
            return out + dense_mlp(spec)
        router, experts = routed_experts(spec)
        out.append(router)
        if a["router_bias"]:
            out.append(Entry(_M + "gate.e_score_correction_bias", (spec.num_experts,), ROUTER_BIAS, "float32"))
        out.append(experts)
        if a["shared_intermediate_size"]:
            out += gated_mlp_entries(_M + "shared_experts.", a["shared_intermediate_size"], H, SHARED_MLP)
        return out

    def megatron_options(self, spec: ModelSpec) -> dict[str, Any]:
        a = dict(spec.arch)
        out: dict[str, Any] = dict(multi_latent_attention=True, qk_layernorm=True, q_lora_rank=a["q_lora_rank"],
                                   kv_lora_rank=a["kv_lora_rank"], qk_head_dim=a["qk_nope_head_dim"],
                                   qk_pos_emb_head_dim=a["qk_rope_head_dim"], v_head_dim=a["v_head_dim"])
        if a["shared_intermediate_size"]:
            out["moe_shared_expert_intermediate_size"] = a["shared_intermediate_size"]
        if a["router_bias"]:
            out["moe_router_enable_expert_bias"] = True
        return out

    def tiny_config(self, config: dict[str, Any]) -> dict[str, Any]:
        out = super().tiny_config(config)
        out.pop("head_dim", None)
        out.update(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                   n_group=1, topk_group=1, rope_scaling=None, num_hidden_layers=3,
                   first_k_dense_replace=min(config.get("first_k_dense_replace", 0) or 0, 1))
        if config.get("q_lora_rank") is not None:
            out["q_lora_rank"] = 32
        return out

    def stream_extras(self, spec: ModelSpec) -> tuple[StreamExtra, ...]:
        """Also the MTP layers `model.layers.N.*`, N >= num_layers, which Megatron-Bridge and mbridge export."""
        L = spec.num_layers
        return super().stream_extras(spec) + (StreamExtra(
            f"multi-token-prediction layers model.layers.{L}+.* (Megatron-Bridge / mbridge with MTP)",
            r"model\.layers\.(?P<layer>\d+)\..+", (L, L + MAX_LAYERS)),)

    def excluded(self, config: dict[str, Any]) -> list[str]:
        n = config.get("num_nextn_predict_layers") or 0
        L = config.get("num_hidden_layers", 0)
        layers = f"model.layers.{L}.*" if n == 1 else f"model.layers.{L}..{L + n - 1}.*"
        return [f"multi-token-prediction layers {layers} (num_nextn_predict_layers={n})"] if n else []
