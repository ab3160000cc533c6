"""Canonical tensors of a model: HF checkpoint names, global shapes and the role each plays.

A role says how a tensor behaves under parallelism (vocab-parallel, column, row, replicated,
expert ...). Layouts dispatch on the role, never on substrings of the name.
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from ..errors import ModelConfigError

DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


class Role(str, enum.Enum):
    EMBED = "embed"
    LM_HEAD = "lm_head"
    FINAL_NORM = "final_norm"
    INPUT_NORM = "input_norm"
    POST_ATTN_NORM = "post_attn_norm"
    Q_NORM = "q_norm"
    K_NORM = "k_norm"
    Q = "q"
    K = "k"
    V = "v"
    O = "o"
    GATE = "gate"
    UP = "up"
    DOWN = "down"
    ROUTER = "router"
    EXPERT_GATE = "expert_gate"
    EXPERT_UP = "expert_up"
    EXPERT_DOWN = "expert_down"

    @property
    def is_expert(self) -> bool:
        return self in (Role.EXPERT_GATE, Role.EXPERT_UP, Role.EXPERT_DOWN)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One canonical tensor. `layer` and `expert` are -1 where they do not apply. `role` is a shared `Role`
    or a family-specific `kinds.Kind` (which carries its own placement rules). `dtype` is set only where a
    tensor keeps another dtype than the model (e.g. a float32 router bias)."""

    index: int
    name: str
    shape: tuple[int, ...]
    role: "Role | Any"
    layer: int = -1
    expert: int = -1
    dtype: str | None = None

    @property
    def numel(self) -> int:
        return functools.reduce(lambda a, b: a * b, self.shape, 1)


class ModelSpec(BaseModel):
    """The facts about a decoder-only transformer that decide where its bytes live."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    family: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    moe_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()  # MLP-only layers of a MoE model
    dtype: str = "bfloat16"
    # Family-specific facts (MLA ranks, linear-attention heads, layer types ...) as sorted (key, value) pairs,
    # so the spec stays hashable and JSON round-trips; read them with `spec.arch_value(key)`.
    arch: tuple[tuple[str, Any], ...] = ()

    @field_validator("arch", mode="before")
    @classmethod
    def _freeze_arch(cls, value: Any) -> tuple[tuple[str, Any], ...]:
        items = value.items() if isinstance(value, dict) else value
        return tuple(sorted((str(k), _frozen(v)) for k, v in items))

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        problems = []
        for field in ("hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads",
                      "head_dim", "vocab_size"):
            if getattr(self, field) <= 0:
                problems.append(f"{field}={getattr(self, field)} must be positive")
        if self.num_key_value_heads > 0 and self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"num_attention_heads={self.num_attention_heads} is not divisible by "
                            f"num_key_value_heads={self.num_key_value_heads}")
        if self.num_experts and self.moe_intermediate_size <= 0:
            problems.append("a MoE model needs moe_intermediate_size > 0")
        if (not self.num_experts or self.dense_layers) and self.intermediate_size <= 0:
            problems.append("dense MLP layers need intermediate_size > 0")
        if self.dtype not in DTYPE_SIZES:
            problems.append(f"dtype={self.dtype!r} is not one of {sorted(DTYPE_SIZES)}")
        bad = [i for i in self.dense_layers if not 0 <= i < self.num_layers]
        if bad:
            problems.append(f"dense_layers {bad} are outside [0, {self.num_layers})")
        from .families import _BY_NAME

        if self.family not in _BY_NAME:
            problems.append(f"family={self.family!r} is not registered (registered: {', '.join(sorted(_BY_NAME))})")
        if problems:
            raise ModelConfigError("invalid model spec: " + "; ".join(problems))
        return self

    def arch_value(self, key: str, default: Any = None) -> Any:
        for k, v in self.arch:
            if k == key:
                return v
        return default

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer not in self.dense_layers

    @property
    def tensors(self) -> tuple[TensorSpec, ...]:
        return _canonical_tensors(self)

    def tensor(self, name: str) -> TensorSpec:
        by_name = _tensors_by_name(self)
        if name not in by_name:
            raise KeyError(f"{name!r} is not a tensor of this {self.family} model")
        return by_name[name]

    @property
    def num_params(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def num_bytes(self) -> int:
        return self.num_params * self.itemsize

    def __str__(self) -> str:
        moe = f", {self.num_experts} experts x {self.moe_intermediate_size}" if self.is_moe else ""
        return (f"{self.family}(L={self.num_layers}, H={self.hidden_size}, heads={self.num_attention_heads}/"
                f"{self.num_key_value_heads}x{self.head_dim}, F={self.intermediate_size}{moe}, "
                f"V={self.vocab_size}, {self.num_params / 1e9:.2f}B params)")

    @classmethod
    def from_hf_config(cls, config: "dict | str", include_mtp: bool = False) -> "ModelSpec":
        from .families import spec_from_hf_config

        return spec_from_hf_config(config, include_mtp=include_mtp)


def _frozen(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    return value


@functools.lru_cache(maxsize=64)
def _canonical_tensors(spec: ModelSpec) -> tuple[TensorSpec, ...]:
    """The family (reshard/layouts/families/) lists the tensors; here they get their indices."""
    from .families import family

    rows = family(spec.family).tensors(spec)
    return tuple(TensorSpec(k, *row) for k, row in enumerate(rows))


@functools.lru_cache(maxsize=64)
def _tensors_by_name(spec: ModelSpec) -> dict[str, TensorSpec]:
    return {t.name: t for t in _canonical_tensors(spec)}
