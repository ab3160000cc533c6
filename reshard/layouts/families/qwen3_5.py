"""Qwen3.5 / Qwen3.6, dense and MoE: Gated DeltaNet linear-attention layers among gated full-attention layers
(`layer_types`, or every `full_attention_interval`-th layer full), then a SwiGLU MLP or a router, routed experts
and one gated shared expert.

The multimodal wrapper (`Qwen3_5[Moe]ForConditionalGeneration`, fields under `text_config`) names the language
model `model.language_model.*` (vLLM: `language_model.model.*`); the vision tower and the MTP layers (`mtp.*`)
are left out of refits. Text-only checkpoints use plain `model.*` names.

Sources: transformers' modeling_qwen3_5[_moe].py, megatron-core's ssm/gated_delta_net and vLLM's qwen3_5.py /
qwen3_next.py / qwen_gdn_linear_attn.py (versions: docs/guides/layouts.md). HF's in_proj_qkv / in_proj_z /
in_proj_b / in_proj_a are parts of Megatron's fused per-rank stack in_proj [q;k;v;z;b;a]_r and vLLM's
in_proj_qkvz [q;k;v;z]_r and in_proj_ba [b;a]_r; conv1d [C, 1, K] is [q;k;v]_r on both, cut on dim 0 only. The
gated q_proj holds [q_h; gate_h] per head; Megatron's linear_qkv per group [q; gate; k; v], vLLM's qkv_proj
[q, gate of its heads; k_r; v_r]. Routed experts use the shared roles under HF's per-expert names.
vLLM keeps A_log in float32; a refit at the model dtype casts there."""
from __future__ import annotations

import functools
from typing import Any

from ...errors import ModelConfigError
from ...limits import MAX_DIM, MAX_EXPERTS, MAX_HEADS, MAX_LAYERS, check_limit
from ..cuts import ColumnBlocks, Replicated, RowBlocks, Stacked, TensorKind
from ..family import (LAYER, ModelFamily, StreamExtra, dense_mlp, gated_mlp_entries, gqa_attention, norm,
                      routed_experts)
from ..hf_config import REQUIRED, get_bool, get_int, get_str_list
from ..model import Entry, Experts, ModelSpec, Role
from ..roles import gated_mlp, qkv_kinds, tensor_kind

_LIN = LAYER + "linear_attn."
_MLP = LAYER + "mlp."
_LAYER_TYPES = ("linear_attention", "full_attention")

GDN_INPUT_NORM = tensor_kind("gdn_input_norm", Replicated("input_layernorm.weight"),
                             Replicated(LAYER + "input_layernorm.weight"),
                             te=Replicated("self_attention.in_proj.layer_norm_weight"))
GDN_DT_BIAS, GDN_A_LOG = (tensor_kind(f"gdn_{x.lower()}", RowBlocks("self_attention." + x), RowBlocks(_LIN + x))
                          for x in ("dt_bias", "A_log"))
# The GDN output norm is a plain RMSNorm weight in HF and vLLM, but Megatron builds it zero-centred: it stores w - 1.
GDN_NORM = tensor_kind("gdn_norm", Replicated("self_attention.out_norm.weight"), Replicated(_LIN + "norm.weight"),
                       megatron_offset=-1.0)
GDN_OUT = tensor_kind("gdn_out_proj",
                      ColumnBlocks("self_attention.out_proj.weight"), ColumnBlocks(_LIN + "out_proj.weight"))
SHARED_MLP = gated_mlp("mlp.shared_experts.", _MLP + "shared_expert.", "shared_expert_proj_")
SHARED_EXPERT_GATE = tensor_kind("shared_expert_gate", Replicated("mlp.shared_experts.gate_weight"),
                                 Replicated(_MLP + "shared_expert_gate.weight"))


@functools.lru_cache(maxsize=16)
def _gdn_kinds(nk: int, dk: int, nv: int, dv: int) -> dict[str, TensorKind]:
    """in_proj / conv1d kinds: each HF tensor is consecutive parts of a fused per-rank stack of whole heads."""
    Kd, Vd = nk * dk, nv * dv
    meg, meg_h = (Kd, Kd, Vd, Vd, nv, nv), (dk, dk, dv, dv, 1, 1)  # Megatron in_proj: q, k, v, z, beta, alpha
    qkvz, qkvz_h = (Kd, Kd, Vd, Vd), (dk, dk, dv, dv)
    conv, conv_h = (Kd, Kd, Vd), (dk, dk, dv)

    def kind(label, mfirst, mcount, vname, vsizes, vheads, vfirst, vcount):
        return tensor_kind(label, Stacked("self_attention.in_proj.weight", meg, mfirst, mcount, meg_h),
                           Stacked(_LIN + vname, vsizes, vfirst, vcount, vheads))

    return {"in_proj_qkv": kind("gdn_in_proj_qkv", 0, 3, "in_proj_qkvz.weight", qkvz, qkvz_h, 0, 3),
            "in_proj_z": kind("gdn_in_proj_z", 3, 1, "in_proj_qkvz.weight", qkvz, qkvz_h, 3, 1),
            "in_proj_b": kind("gdn_in_proj_b", 4, 1, "in_proj_ba.weight", (nv, nv), (), 0, 1),
            "in_proj_a": kind("gdn_in_proj_a", 5, 1, "in_proj_ba.weight", (nv, nv), (), 1, 1),
            "conv1d": tensor_kind("gdn_conv1d", Stacked("self_attention.conv1d.weight", conv, 0, 3, conv_h),
                                  Stacked(_LIN + "conv1d.weight", conv, 0, 3, conv_h))}


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields: the wrapper's `text_config` (its dtype and tied flag as fallbacks), or `config`."""
    if "text_config" not in config:
        return config
    text = config["text_config"]
    if not isinstance(text, (dict, type(None))):
        raise ModelConfigError(field="text_config", value=text, rule="must be a JSON object")
    text = dict(text or {})
    for key in ("torch_dtype", "dtype", "tie_word_embeddings"):
        if key in config and key not in text:
            text[key] = config[key]
    if "dtype" in text and "torch_dtype" not in text:
        text["torch_dtype"] = text["dtype"]
    return text


class Qwen35(ModelFamily):
    """Qwen3.5 (dense and MoE, text and vision-language): gated DeltaNet among gated full-attention layers."""
    name = "qwen3_5"
    architectures = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
                     "Qwen3_5MoeForConditionalGeneration")
    model_types = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
    megatron_block = "gated_delta_net"

    def spec(self, config: dict[str, Any], include_mtp: bool = False) -> ModelSpec:
        multimodal = "text_config" in config
        t = text_config(config)
        self._refuse_mtp(t, include_mtp, "mtp_num_hidden_layers", "mtp.*")
        if not get_bool(t, "attn_output_gate", True, null_is_default=True):
            raise ModelConfigError(field="attn_output_gate", value=False, rule="is not supported: transformers' "
                                   "Qwen3.5 always gates attention (q_proj holds 2 rows per head), so the checkpoint "
                                   "would not match")
        if "tie_word_embeddings" in config and "text_config" in config and \
                config["tie_word_embeddings"] != t.get("tie_word_embeddings", False):
            raise ModelConfigError(field="tie_word_embeddings", value=config["tie_word_embeddings"],
                                   rule="differs between the config and its text_config")
        fields = self._common(t, qk_norm=True)
        L = fields["num_layers"]
        lin = {k: get_int(t, k, maximum=MAX_HEADS if k.endswith("heads") else MAX_DIM) for k in (
            "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim")}
        for key in ("linear_num_key_heads", "linear_num_value_heads"):
            dim = "linear_key_head_dim" if "key" in key else "linear_value_head_dim"
            check_limit(f"{key} * {dim}", lin[key] * lin[dim], MAX_DIM, "a dimension", "model config")
        if "layer_types" in t and t["layer_types"] is not None:
            types = list(get_str_list(t, "layer_types", L, _LAYER_TYPES))
        else:
            every = get_int(t, "full_attention_interval", 4, maximum=MAX_LAYERS, null_is_default=True, what="layers")
            types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(L)]
        nk, nv = lin["linear_num_key_heads"], lin["linear_num_value_heads"]
        if nv % nk:
            raise ModelConfigError(field="linear_num_value_heads", value=nv,
                                   rule=f"is not a multiple of linear_num_key_heads={nk}")
        moe_arch = str(config.get("model_type", "")).startswith("qwen3_5_moe") or any(
            str(a).startswith("Qwen3_5Moe") for a in config.get("architectures") or ())
        # a MoE architecture needs experts (0 would silently build a dense model); a dense one may say 0
        E = get_int(t, "num_experts", REQUIRED if moe_arch else 0, minimum=1 if moe_arch else 0,
                    maximum=MAX_EXPERTS, null_is_default=not moe_arch, what="experts")
        moe = {}
        if E:
            moe = dict(num_experts=E, moe_intermediate_size=get_int(t, "moe_intermediate_size"))
            fields["intermediate_size"] = 0  # every layer is sparse (transformers and vLLM build no dense MLP)
        shared = get_int(t, "shared_expert_intermediate_size", 0, minimum=0, null_is_default=True) if E else 0
        return ModelSpec(**fields, **moe, arch={
            "layer_types": tuple(types), **lin, "shared_intermediate_size": shared,
            "shared_expert_gate": bool(E), "zero_centered_norms": True, "multimodal": multimodal,
            "vllm_prefix": "language_model." if multimodal else ""})

    def language_config(self, config: dict[str, Any]) -> dict[str, Any]:
        return text_config(config)

    def hf_model(self, spec: ModelSpec) -> str:  # the multimodal wrapper nests the language model
        return "model.language_model." if spec.arch_value("multimodal") else "model."

    def layer(self, spec: ModelSpec, i: int) -> list[Entry | Experts]:
        """Layer i's tensors under `hf_model` (`model.language_model.` in the multimodal wrapper)."""
        a, H, p = dict(spec.arch), spec.hidden_size, self.hf_model(spec) + "layers.{i}."
        if a["layer_types"][i] == "linear_attention":
            nk, dk, nv, dv = (a[f"linear_{x}"] for x in ("num_key_heads", "key_head_dim", "num_value_heads",
                                                           "value_head_dim"))
            Kd, Vd = nk * dk, nv * dv
            k, q = _gdn_kinds(nk, dk, nv, dv), p + "linear_attn."
            rows = {"in_proj_qkv": 2 * Kd + Vd, "in_proj_z": Vd, "in_proj_b": nv, "in_proj_a": nv}
            out = [norm("input_layernorm.weight", H, GDN_INPUT_NORM, p),
                   *(Entry(f"{q}{x}.weight", (n, H), k[x]) for x, n in rows.items()),
                   Entry(q + "conv1d.weight", (2 * Kd + Vd, 1, a["linear_conv_kernel_dim"]), k["conv1d"]),
                   Entry(q + "dt_bias", (nv,), GDN_DT_BIAS),
                   Entry(q + "A_log", (nv,), GDN_A_LOG),
                   Entry(q + "norm.weight", (dv,), GDN_NORM),
                   Entry(q + "out_proj.weight", (H, Vd), GDN_OUT)]
        else:
            kinds = qkv_kinds(spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim, True,
                              ("gated_q", "gated_k", "gated_v"))
            out = [norm("input_layernorm.weight", H, Role.INPUT_NORM, p), *gqa_attention(spec, p, kinds, gated=True)]
        out.append(norm("post_attention_layernorm.weight", H, Role.POST_ATTN_NORM, p))
        if not spec.is_moe:
            return out + dense_mlp(spec, p)
        out += routed_experts(spec, p)
        Fs, m = a["shared_intermediate_size"], p + "mlp."
        if Fs:
            out += [*gated_mlp_entries(m + "shared_expert.", Fs, H, SHARED_MLP),
                    Entry(m + "shared_expert_gate.weight", (1, H), SHARED_EXPERT_GATE)]
        return out

    def megatron_options(self, spec: ModelSpec) -> dict[str, Any]:
        a = dict(spec.arch)
        out: dict[str, Any] = dict(
            experimental_attention_variant="gated_delta_net", attention_output_gate=True,
            linear_attention_freq=[int(x == "linear_attention") for x in a["layer_types"]],
            layernorm_zero_centered_gamma=True,  # Qwen3.5's RMSNorms compute (1 + weight)
            **{k: a[k] for k in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                                 "linear_num_key_heads", "linear_num_value_heads")})
        if a["shared_intermediate_size"]:
            out.update(moe_shared_expert_intermediate_size=a["shared_intermediate_size"],
                       moe_shared_expert_gate=a["shared_expert_gate"])
        return out

    def tiny_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """Tiny sizes in the text config (nested for the multimodal wrapper, with a one-block vision tower)."""
        t = super().tiny_config(text_config(config))
        types = list(t.get("layer_types") or [])[:4]
        if "full_attention" not in types or "linear_attention" not in types:
            types = ["linear_attention"] * 3 + ["full_attention"]
        t.update(layer_types=types, num_hidden_layers=4, num_key_value_heads=2, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                 max_position_embeddings=128, mtp_num_hidden_layers=0)
        t.pop("full_attention_interval", None)
        if t.get("num_experts"):
            t["shared_expert_intermediate_size"] = 32
        if isinstance(t.get("rope_parameters"), dict) and t["rope_parameters"].get("mrope_section"):
            # head_dim 16 x partial_rotary_factor 0.25 = 4 rotary dims: the mRoPE sections must sum to half of it
            t["rope_parameters"] = dict(t["rope_parameters"], mrope_section=[1, 1, 0])
        if "text_config" not in config:
            return t
        out = {k: v for k, v in config.items() if k not in ("text_config", "quantization_config", "auto_map")}
        vision = dict(config.get("vision_config") or {})
        vision.update(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=t["hidden_size"],
                      num_position_embeddings=16, deepstack_visual_indexes=[])
        out.update(text_config=t, vision_config=vision, torch_dtype="float32",
                   tie_word_embeddings=t.get("tie_word_embeddings", False))
        return out

    def stream_extras(self, spec: ModelSpec) -> tuple[StreamExtra, ...]:
        """Also the MTP tensors `mtp.*` and, in the multimodal wrapper, the vision tower `model.visual.*`."""
        out = super().stream_extras(spec) + (
            StreamExtra("multi-token-prediction tensors mtp.* (Megatron-Bridge / mbridge with MTP)", r"mtp\..+"),)
        if spec.arch_value("multimodal"):
            out += (StreamExtra("the vision tower model.visual.* (refits leave it out)", r"model\.visual\..+"),)
        return out

    def excluded(self, config: dict[str, Any]) -> list[str]:
        t = text_config(config)
        out = []
        if "text_config" in config:
            out.append("the vision tower (model.visual.*)")
        if t.get("mtp_num_hidden_layers"):
            out.append(f"multi-token-prediction layers mtp.* (mtp_num_hidden_layers={t['mtp_num_hidden_layers']})")
        return out
