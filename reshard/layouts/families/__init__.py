"""Model families: one small file each, describing a family as data.

A family says (1) how an HF `config.json` becomes a ModelSpec, (2) the canonical tensors of that spec (HF
checkpoint names, shapes, roles), (3) through the roles, how each tensor maps into Megatron (local and TE
names) and into vLLM: the shared `Role`s are placed by the layouts' built-in rules, family-specific tensors
carry a `kinds.Kind` with their own small rules, (4) which tensors are experts (distributed by expert
parallelism) and which are dense, and (5) what the checkpoint holds that refits leave out (e.g. multi-token
prediction layers).

Architecture discovery reads `architectures` and then `model_type`; an unknown one gets an error that lists
the supported ones. Adding a family = one module here, imported at the bottom of this file.
"""
from __future__ import annotations

import abc
import json
from pathlib import Path
from typing import Any, ClassVar, Iterable

from ...errors import ModelConfigError
from ..model import ModelSpec, Role

_FAMILIES: dict[str, "ModelFamily"] = {}   # architecture or model_type -> family
_BY_NAME: dict[str, "ModelFamily"] = {}    # ModelSpec.family -> family

_HF_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "fp8": "float8_e4m3fn"}

# (name, shape, role, layer, expert): one canonical tensor before it gets its index.
Row = tuple[str, tuple[int, ...], Any, int, int]


class ModelFamily(abc.ABC):
    """A family: its config keys, its canonical tensors, and the layout constraints of its own tensors."""

    name: ClassVar[str]
    architectures: ClassVar[tuple[str, ...]]
    model_types: ClassVar[tuple[str, ...]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not getattr(cls, "__abstractmethods__", None):
            family = cls()
            for key in cls.architectures + cls.model_types:
                _FAMILIES[key] = family
            _BY_NAME[cls.name] = family

    @abc.abstractmethod
    def spec(self, config: dict[str, Any], include_mtp: bool = False) -> ModelSpec: ...

    @abc.abstractmethod
    def tensors(self, spec: ModelSpec) -> Iterable[Row]:
        """The canonical tensors in checkpoint order."""

    def excluded(self, config: dict[str, Any]) -> list[str]:
        """What the HF checkpoint holds that a refit leaves out, in words (empty: nothing)."""
        return []

    # Small sizes for a tiny instance of the same structure (validation builds it on CPU). Families add their
    # own keys in `tiny_config`; flags and layer patterns are kept.
    TINY: ClassVar[dict[str, Any]] = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
                                      "head_dim": 16, "vocab_size": 128, "max_position_embeddings": 128}

    def tiny_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The same family and structure at toy sizes: at most 4 layers, 64 wide, 4 experts."""
        out = {k: v for k, v in config.items() if k not in ("quantization_config", "auto_map")}
        out.update(self.TINY)
        out["num_hidden_layers"] = min(config.get("num_hidden_layers", 4), 4)
        heads, kv = config.get("num_attention_heads", 4), config.get("num_key_value_heads") or config.get(
            "num_attention_heads", 4)
        out["num_key_value_heads"] = 4 if kv == heads else 2  # keep MHA vs GQA
        for key in ("num_experts", "n_routed_experts", "num_local_experts"):
            if config.get(key):
                out[key] = 4
        if config.get("moe_intermediate_size"):
            out["moe_intermediate_size"] = 32
        if config.get("num_experts_per_tok"):
            out["num_experts_per_tok"] = 2
        out["torch_dtype"] = "float32"
        return out

    # --- helpers shared by the families ----------------------------------------------------------------
    @staticmethod
    def _require(config: dict[str, Any], *keys: str) -> None:
        missing = [k for k in keys if k not in config]
        if missing:
            raise ModelConfigError(f"config is missing {missing}")

    @staticmethod
    def _refuse_mtp_and_activation(config: dict[str, Any], include_mtp: bool, mtp_key: str, mtp_names: str) -> None:
        """What no family supports yet: multi-token-prediction layers asked for, an activation other than silu."""
        if include_mtp and config.get(mtp_key):
            raise ModelConfigError(f"multi-token-prediction layers ({mtp_names}) are not supported yet: Megatron "
                                   "keeps them in a separate mtp block and vLLM in a separate draft model; refit "
                                   "without them")
        if config.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"hidden_act={config['hidden_act']!r} is not supported (silu only)")

    def _common(self, config: dict[str, Any], qk_norm: bool, biases: tuple[str, ...] = ("attention_bias", "mlp_bias")
                ) -> dict[str, Any]:
        self._require(config, "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        heads = config["num_attention_heads"]
        dtype = config.get("torch_dtype", config.get("dtype", "bfloat16")) or "bfloat16"
        if dtype not in _HF_DTYPES:
            raise ModelConfigError(f"dtype {dtype!r} is not one of {sorted(_HF_DTYPES)}")
        for flag in biases:
            if config.get(flag):
                raise ModelConfigError(f"{flag}=true is not supported (the {self.name} family has no biases)")
        if config.get("quantization_config"):
            method = config["quantization_config"].get("quant_method", "?")
            raise ModelConfigError(f"a quantized checkpoint (quantization_config.quant_method={method!r}) is not "
                                   f"supported: refits write unquantized weights; drop quantization_config "
                                   f"and serve the {dtype} weights")
        return dict(
            family=self.name,
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate_size=config.get("intermediate_size", 0),
            vocab_size=config["vocab_size"],
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qk_norm=qk_norm,
            dtype=_HF_DTYPES[dtype],
        )


# --- building blocks of decoder tensor lists ------------------------------------------------------------

def decoder(spec: ModelSpec, layer: "callable") -> list[Row]:
    """embed, each layer's tensors (from `layer(spec, i)`), final norm, untied lm_head."""
    H = spec.hidden_size
    out: list[Row] = [("model.embed_tokens.weight", (spec.vocab_size, H), Role.EMBED, -1, -1)]
    for i in range(spec.num_layers):
        out += layer(spec, i)
    out.append(("model.norm.weight", (H,), Role.FINAL_NORM, -1, -1))
    if not spec.tie_word_embeddings:
        out.append(("lm_head.weight", (spec.vocab_size, H), Role.LM_HEAD, -1, -1))
    return out


def gqa_attention(spec: ModelSpec, i: int) -> list[Row]:
    """q/k/v/o projections (+ per-head q/k norms when the spec has them)."""
    H, d, p = spec.hidden_size, spec.head_dim, f"model.layers.{i}.self_attn."
    out = [(p + "q_proj.weight", (spec.num_attention_heads * d, H), Role.Q, i, -1),
           (p + "k_proj.weight", (spec.num_key_value_heads * d, H), Role.K, i, -1),
           (p + "v_proj.weight", (spec.num_key_value_heads * d, H), Role.V, i, -1),
           (p + "o_proj.weight", (H, spec.num_attention_heads * d), Role.O, i, -1)]
    if spec.qk_norm:
        out += [(p + "q_norm.weight", (d,), Role.Q_NORM, i, -1), (p + "k_norm.weight", (d,), Role.K_NORM, i, -1)]
    return out


def dense_mlp(spec: ModelSpec, i: int, prefix: str = "mlp.") -> list[Row]:
    H, F, p = spec.hidden_size, spec.intermediate_size, f"model.layers.{i}.{prefix}"
    return [(p + "gate_proj.weight", (F, H), Role.GATE, i, -1), (p + "up_proj.weight", (F, H), Role.UP, i, -1),
            (p + "down_proj.weight", (H, F), Role.DOWN, i, -1)]


def routed_experts(spec: ModelSpec, i: int) -> list[Row]:
    """The router and the per-expert gate/up/down projections (HF per-expert checkpoint names)."""
    H, Fm, p = spec.hidden_size, spec.moe_intermediate_size, f"model.layers.{i}.mlp."
    out: list[Row] = [(p + "gate.weight", (spec.num_experts, H), Role.ROUTER, i, -1)]
    for e in range(spec.num_experts):
        q = f"{p}experts.{e}."
        out += [(q + "gate_proj.weight", (Fm, H), Role.EXPERT_GATE, i, e),
                (q + "up_proj.weight", (Fm, H), Role.EXPERT_UP, i, e),
                (q + "down_proj.weight", (H, Fm), Role.EXPERT_DOWN, i, e)]
    return out


def norm(i: int, name: str, size: int, role: Any) -> Row:
    return (f"model.layers.{i}.{name}", (size,), role, i, -1)


# --- registry -------------------------------------------------------------------------------------------

def family(name: str) -> ModelFamily:
    """The family a ModelSpec names."""
    if name not in _BY_NAME:
        raise ModelConfigError(f"unknown model family {name!r}; registered: {', '.join(sorted(_BY_NAME))}")
    return _BY_NAME[name]


def registered_families() -> list[str]:
    return sorted(_BY_NAME)


def supported_architectures() -> list[str]:
    return sorted(k for k in _FAMILIES if k[:1].isupper())


def read_hf_config(config: "dict[str, Any] | str | Path") -> dict[str, Any]:
    """An HF config as a dict, from a dict, a config.json path, or a checkpoint directory."""
    if isinstance(config, dict):
        return config
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelConfigError(f"no HF config at {path}") from None
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path} is not valid JSON: {exc}") from None


def discover(config: "dict[str, Any] | str | Path") -> ModelFamily:
    """The family of an HF config, by `architectures` first, then `model_type`."""
    config = read_hf_config(config)
    for key in list(config.get("architectures") or ()) + [config.get("model_type", "")]:
        if key in _FAMILIES:
            return _FAMILIES[key]
    raise ModelConfigError(
        f"unknown architecture {config.get('architectures')} (model_type={config.get('model_type')!r}); "
        f"supported: {', '.join(supported_architectures())}")


def spec_from_hf_config(config: "dict[str, Any] | str | Path", include_mtp: bool = False) -> ModelSpec:
    """Build a ModelSpec from an HF config dict, a config.json path, or a checkpoint directory."""
    config = read_hf_config(config)
    return discover(config).spec(config, include_mtp=include_mtp)


# Registering a family = importing its module.
from . import deepseek_v3, llama, qwen3, qwen3_5, qwen3_moe  # noqa: E402,F401

__all__ = ["ModelFamily", "decoder", "dense_mlp", "discover", "family", "gqa_attention", "norm",
           "read_hf_config", "registered_families", "routed_experts", "spec_from_hf_config",
           "supported_architectures"]
