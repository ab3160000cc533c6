"""The HF config fields that change a model's math but no tensor's shape: models differing there share layouts and
plans, so a refit between them would serve wrong outputs. `ModelSpec.from_hf_config` keeps them in
`ModelSpec.math`, `RefitSpec.of` sends them, and a vLLM worker compares them with its own model's before a byte
moves. Rope settings are compared in one form ("rope_theta", "rope_scaling"), whatever transformers version wrote
them, under the checkpoint's rope type name."""
from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Mapping

from ..errors import ModelConfigError

# name -> what it changes
MATH_FIELDS = {
    "hidden_act": "the MLP's activation",
    "rms_norm_eps": "every RMSNorm",
    "layer_norm_eps": "every LayerNorm",
    "layer_norm_epsilon": "every LayerNorm",
    "rope_theta": "rotary embedding frequencies",
    "rope_scaling": "rotary embedding scaling (type and parameters)",
    "partial_rotary_factor": "how much of each head is rotated",
    "num_experts_per_tok": "MoE top-k",
    "norm_topk_prob": "whether MoE top-k weights are renormalized",
    "scoring_func": "the MoE router's scoring",
    "topk_method": "the MoE router's selection",
    "n_group": "grouped MoE routing",
    "topk_group": "grouped MoE routing",
    "routed_scaling_factor": "the scale of routed experts' output",
    "sliding_window": "the attention window",
    "use_sliding_window": "the attention window",
    "max_window_layers": "which layers use the window",
    "attn_logit_softcapping": "attention logits",
    "final_logit_softcapping": "output logits",
    "query_pre_attn_scalar": "the attention scale",
}


# vLLM's names for a checkpoint's rope type, written into the served model's config (same math, another kernel name)
_ROPE_ALIASES = {"deepseek_yarn": "yarn"}


def _rope(config: Mapping[str, Any]) -> dict[str, Any]:
    params = config.get("rope_parameters")
    scaling = config.get("rope_scaling")
    out: dict[str, Any] = {}
    theta = config.get("rope_theta")
    if isinstance(params, Mapping):
        theta = params.get("rope_theta", theta)
        scaling = {k: v for k, v in params.items() if k != "rope_theta"} if scaling is None else scaling
    if theta is not None:
        out["rope_theta"] = float(theta) if isinstance(theta, (int, float)) and not isinstance(theta, bool) else theta
    if isinstance(scaling, Mapping):
        scaling = {("rope_type" if k == "type" else k): v for k, v in scaling.items() if k != "rope_theta"}
        if scaling.get("rope_type") in _ROPE_ALIASES:
            scaling["rope_type"] = _ROPE_ALIASES[scaling["rope_type"]]
        if scaling and scaling != {"rope_type": "default"}:
            out["rope_scaling"] = scaling
    return out


def math_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of MATH_FIELDS an HF config sets (rope normalized), as JSON values; ModelConfigError naming a
    field whose value is not JSON (they travel to the engines as JSON)."""
    out = {k: config[k] for k in MATH_FIELDS if k in config and k not in ("rope_theta", "rope_scaling")
           and config[k] is not None}
    out.update(_rope(config))
    for key, value in out.items():
        try:
            json.dumps(value, default=str)
        except (TypeError, ValueError) as e:
            raise ModelConfigError(field=key, value=value, rule=f"must be a JSON value ({e})") from None
    return json.loads(json.dumps(out, sort_keys=True, default=str))


def math_fingerprint(math_fields: Mapping[str, Any]) -> str:
    """SHA-256 of the math fields as canonical JSON (both sides compute it alike)."""
    return hashlib.sha256(json.dumps(dict(math_fields), sort_keys=True, default=str).encode()).hexdigest()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def math_differences(trainer: Mapping[str, Any], engine: Mapping[str, Any]) -> list[str]:
    """The fields whose values differ (a field only one side sets is not compared: configs omit defaults)."""
    return [f"{k}: trainer {trainer[k]!r}, engine {engine[k]!r} ({MATH_FIELDS.get(k, k)})"
            for k in sorted(trainer) if k in engine and not _same(trainer[k], engine[k])]


__all__ = ["MATH_FIELDS", "math_config", "math_differences", "math_fingerprint"]
