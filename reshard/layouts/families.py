"""Model families: how an HF `config.json` becomes a ModelSpec.

Each family is a small class registered by the architectures it reads. Unknown architectures get
an error that lists the supported ones.
"""
from __future__ import annotations

import abc
import json
from pathlib import Path
from typing import Any, ClassVar

from ..errors import ModelConfigError
from .model import ModelSpec

_FAMILIES: dict[str, "ModelFamily"] = {}

_HF_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "fp8": "float8_e4m3fn"}


class ModelFamily(abc.ABC):
    """Turns one family's HF config into a ModelSpec."""

    name: ClassVar[str]
    architectures: ClassVar[tuple[str, ...]]
    model_types: ClassVar[tuple[str, ...]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not getattr(cls, "__abstractmethods__", None):
            family = cls()
            for key in cls.architectures + cls.model_types:
                _FAMILIES[key] = family

    @abc.abstractmethod
    def spec(self, config: dict[str, Any]) -> ModelSpec: ...

    @staticmethod
    def _require(config: dict[str, Any], *keys: str) -> None:
        missing = [k for k in keys if k not in config]
        if missing:
            raise ModelConfigError(f"config is missing {missing}")

    def _common(self, config: dict[str, Any], qk_norm: bool) -> dict[str, Any]:
        self._require(config, "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        heads = config["num_attention_heads"]
        dtype = config.get("torch_dtype", config.get("dtype", "bfloat16")) or "bfloat16"
        if dtype not in _HF_DTYPES:
            raise ModelConfigError(f"dtype {dtype!r} is not one of {sorted(_HF_DTYPES)}")
        for flag in ("attention_bias", "mlp_bias"):
            if config.get(flag):
                raise ModelConfigError(f"{flag}=true is not supported (the {self.name} family has no biases)")
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


class Qwen3(ModelFamily):
    name = "qwen3"
    architectures = ("Qwen3ForCausalLM",)
    model_types = ("qwen3",)

    def spec(self, config: dict[str, Any]) -> ModelSpec:
        return ModelSpec(**self._common(config, qk_norm=True))


class Qwen3Moe(ModelFamily):
    name = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)
    model_types = ("qwen3_moe",)

    def spec(self, config: dict[str, Any]) -> ModelSpec:
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


class Llama(ModelFamily):
    name = "llama"
    architectures = ("LlamaForCausalLM",)
    model_types = ("llama",)

    def spec(self, config: dict[str, Any]) -> ModelSpec:
        return ModelSpec(**self._common(config, qk_norm=False))


def supported_architectures() -> list[str]:
    return sorted(k for k in _FAMILIES if k[:1].isupper())


def spec_from_hf_config(config: "dict[str, Any] | str | Path") -> ModelSpec:
    """Build a ModelSpec from an HF config dict, a config.json path, or a checkpoint directory."""
    if not isinstance(config, dict):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        try:
            config = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelConfigError(f"no HF config at {path}") from None
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{path} is not valid JSON: {exc}") from None
    for key in list(config.get("architectures") or ()) + [config.get("model_type", "")]:
        if key in _FAMILIES:
            return _FAMILIES[key].spec(config)
    raise ModelConfigError(
        f"unknown architecture {config.get('architectures')} (model_type={config.get('model_type')!r}); "
        f"supported: {', '.join(supported_architectures())}")
