"""Canonical tensors of a model: HF checkpoint names, global shapes and the role each plays.

A family lists a layer's tensors as `Entry`s (an HF name template, a shape, a role); the spec turns those
lists into the `CanonicalTable`, one row per tensor, with numpy. A role is a shared `Role` (embed, q, gate,
experts ...) or a family's own `cuts.Kind`; layouts place a tensor by its role's cuts, never by its name.
"""
from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass
from typing import Any, Hashable

import numpy as np
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from ..errors import ModelConfigError
from . import registry

DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
LAYER = "model.layers.{i}."  # HF (and vLLM) prefix of layer i's tensors


class Role(str, enum.Enum):
    """The roles every decoder shares; `roles.py` says where each lives on each side."""

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
    or a family's own `cuts.Kind`. `dtype` is set only where a tensor keeps another dtype than the model (e.g.
    a float32 router bias)."""

    index: int
    name: str
    shape: tuple[int, ...]
    role: Hashable
    layer: int = -1
    expert: int = -1
    dtype: str | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Entry:
    """One tensor of a family's list: its HF name (`{i}` the layer, `{e}` the expert), shape and role."""

    name: str
    shape: tuple[int, ...]
    role: Hashable
    dtype: str | None = None  # only where it differs from the model's (a float32 router bias)


@dataclass(frozen=True)
class Experts:
    """Entries repeated for each of `count` experts, expert by expert (HF's per-expert checkpoint order)."""

    entries: tuple[Entry, ...]
    count: int


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
        if not registry.is_registered(self.family):
            problems.append(f"family={self.family!r} is not registered (registered: "
                            f"{', '.join(registry.registered_families())})")
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

    @property
    def own_dtype_tensors(self) -> tuple[TensorSpec, ...]:
        """The canonical tensors kept in another dtype than the model's (DeepSeek-V3's float32 router bias)."""
        return _own_dtype_tensors(self)

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
    def canonical(self) -> "CanonicalTable":
        """The canonical tensors as arrays (same order and indices as `tensors`), built without a Python object
        per tensor: what compilers and batched placements use at scale."""
        return _canonical_table(self)

    def tensor_at(self, index: int) -> TensorSpec:
        """`tensors[index]`, built alone (the whole tuple costs a Python object per tensor)."""
        c = self.canonical
        e = c.entries[int(c.entry[index])]
        return TensorSpec(int(index), self.tensor_name(index), e.shape, e.role, int(c.layer[index]),
                          int(c.expert[index]), e.dtype)

    def tensor_name(self, index: int) -> str:
        """The HF name of canonical tensor `index`, without building every TensorSpec."""
        c = self.canonical
        if not 0 <= index < len(c):
            raise KeyError(f"canonical tensor index {index} is outside [0, {len(c)})")
        return c.entries[int(c.entry[index])].name.format(i=int(c.layer[index]), e=int(c.expert[index]))

    @property
    def num_params(self) -> int:
        return int(self.canonical.numel.sum())

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
        return registry.spec_from_hf_config(config, include_mtp=include_mtp)


def _frozen(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    return value


@dataclass(frozen=True, eq=False)
class CanonicalTable:
    """Canonical tensors as columns, index k = `ModelSpec.tensors[k].index`. Shapes are seen as 2-D
    (`rows` x `cols`; a 1-D tensor is one row) because every compiler step works on 2-D boxes. A tensor of more
    dimensions (a depthwise conv1d weight [C, 1, K]) is seen as [prod(leading dims), last dim]: its cuts split
    dim 0 only and keep the middle dimensions whole, so each box stays a rows x cols block of that view."""

    entry: np.ndarray  # code into `entries`: the tensor's name template, shape, role and dtype
    layer: np.ndarray  # -1 where it does not apply
    expert: np.ndarray
    rows: np.ndarray
    cols: np.ndarray
    ndim: np.ndarray
    entries: tuple[Entry, ...]  # the family's distinct entries, in order of first appearance

    def __len__(self) -> int:
        return len(self.entry)

    @property
    def numel(self) -> np.ndarray:
        return self.rows * self.cols


@functools.lru_cache(maxsize=64)
def _canonical_table(spec: ModelSpec) -> CanonicalTable:
    """The family's entries, layer by layer (a layer's list is expanded once per distinct list)."""
    fam = registry.family(spec.family)
    codes: dict[Entry, int] = {}
    expanded: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def expand(items: tuple) -> tuple[np.ndarray, np.ndarray]:
        if items not in expanded:
            entry, expert = [], []
            for item in items:
                if isinstance(item, Experts):
                    ids = [codes.setdefault(e, len(codes)) for e in item.entries]
                    entry.append(np.tile(np.asarray(ids, dtype=np.int64), item.count))
                    expert.append(np.repeat(np.arange(item.count, dtype=np.int64), len(ids)))
                else:
                    entry.append(np.asarray([codes.setdefault(item, len(codes))], dtype=np.int64))
                    expert.append(np.asarray([-1], dtype=np.int64))
            expanded[items] = (np.concatenate(entry), np.concatenate(expert))
        return expanded[items]

    blocks = [(expand(tuple(fam.head(spec))), -1)]
    blocks += [(expand(tuple(fam.layer(spec, i))), i) for i in range(spec.num_layers)]
    blocks.append((expand(tuple(fam.tail(spec))), -1))
    entry = np.concatenate([e for (e, _), _ in blocks])
    expert = np.concatenate([x for (_, x), _ in blocks])
    layer = np.concatenate([np.full(len(e), i, dtype=np.int64) for (e, _), i in blocks])
    entries = tuple(codes)
    i64 = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    per_entry = {"rows": i64([math.prod(e.shape[:-1]) for e in entries]), "cols": i64([e.shape[-1] for e in entries]),
                 "ndim": i64([len(e.shape) for e in entries])}
    table = CanonicalTable(entry, layer, expert, **{k: v[entry] for k, v in per_entry.items()}, entries=entries)
    for a in (table.entry, table.layer, table.expert, table.rows, table.cols, table.ndim):
        a.setflags(write=False)
    return table


@functools.lru_cache(maxsize=64)
def _canonical_tensors(spec: ModelSpec) -> tuple[TensorSpec, ...]:
    c = spec.canonical
    return tuple(TensorSpec(k, e.name.format(i=i, e=x), e.shape, e.role, i, x, e.dtype)
                 for k, (e, i, x) in enumerate(zip([c.entries[j] for j in c.entry.tolist()], c.layer.tolist(),
                                                   c.expert.tolist())))


@functools.lru_cache(maxsize=64)
def _own_dtype_tensors(spec: ModelSpec) -> tuple[TensorSpec, ...]:
    c = spec.canonical
    own = [k for k, e in enumerate(c.entries) if e.dtype is not None and e.dtype != spec.dtype]
    return tuple(spec.tensor_at(k) for k in np.flatnonzero(np.isin(c.entry, own)).tolist()) if own else ()


@functools.lru_cache(maxsize=64)
def _tensors_by_name(spec: ModelSpec) -> dict[str, TensorSpec]:
    return {t.name: t for t in _canonical_tensors(spec)}
