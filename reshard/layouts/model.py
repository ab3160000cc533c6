"""Canonical tensors of a model: HF checkpoint names, global shapes and the role each plays.

A role says how a tensor behaves under parallelism (vocab-parallel, column, row, replicated,
expert ...). Layouts dispatch on the role, never on substrings of the name.
"""
from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
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
        """The canonical tensors as arrays (same order and indices as `tensors`), built without Python objects
        per tensor: what compilers and batched placements use at scale."""
        return _canonical_table(self)

    def tensor_at(self, index: int) -> TensorSpec:
        """`tensors[index]`, built alone (the whole tuple costs a Python object per tensor)."""
        if self.family not in _TABLE_FAMILIES:
            return _canonical_tensors(self)[index]
        c = self.canonical
        shape = (int(c.rows[index]), int(c.cols[index])) if c.ndim[index] == 2 else (int(c.cols[index]),)
        return TensorSpec(int(index), self.tensor_name(index), shape, ROLES[int(c.role[index])],
                          int(c.layer[index]), int(c.expert[index]))

    def tensor_name(self, index: int) -> str:
        """The HF name of canonical tensor `index`, without building every TensorSpec."""
        c = self.canonical
        if not 0 <= index < len(c):
            raise KeyError(f"canonical tensor index {index} is outside [0, {len(c)})")
        if self.family not in _TABLE_FAMILIES:
            return _canonical_tensors(self)[index].name
        role = ROLES[int(c.role[index])]
        return HF_NAMES[role].format(i=int(c.layer[index]), e=int(c.expert[index]))

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
        from .families import spec_from_hf_config

        return spec_from_hf_config(config, include_mtp=include_mtp)


def _frozen(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    return value


ROLES: tuple[Role, ...] = tuple(Role)
ROLE_CODE: dict[Role, int] = {r: k for k, r in enumerate(ROLES)}
# Family-specific kinds (layouts/kinds.py) get codes after the built-in roles, on first sight.
_EXTRA_ROLES: list = []


def role_code(role) -> int:
    code = ROLE_CODE.get(role)
    if code is None:
        if role not in _EXTRA_ROLES:
            _EXTRA_ROLES.append(role)
        code = len(ROLES) + _EXTRA_ROLES.index(role)
    return code


def role_at(code: int):
    """The Role (or family-specific Kind) a code in `CanonicalTable.role` stands for."""
    return ROLES[code] if code < len(ROLES) else _EXTRA_ROLES[code - len(ROLES)]


# Families whose tensors `_canonical_table` lays out directly with numpy; others go through their tensor list.
_TABLE_FAMILIES = ("qwen3", "qwen3_moe", "llama")

HF_NAMES = {  # checkpoint (HF) names of the shared roles; `{i}` is the layer, `{e}` the expert
    Role.EMBED: "model.embed_tokens.weight",
    Role.LM_HEAD: "lm_head.weight",
    Role.FINAL_NORM: "model.norm.weight",
    Role.INPUT_NORM: "model.layers.{i}.input_layernorm.weight",
    Role.POST_ATTN_NORM: "model.layers.{i}.post_attention_layernorm.weight",
    Role.Q_NORM: "model.layers.{i}.self_attn.q_norm.weight",
    Role.K_NORM: "model.layers.{i}.self_attn.k_norm.weight",
    Role.Q: "model.layers.{i}.self_attn.q_proj.weight",
    Role.K: "model.layers.{i}.self_attn.k_proj.weight",
    Role.V: "model.layers.{i}.self_attn.v_proj.weight",
    Role.O: "model.layers.{i}.self_attn.o_proj.weight",
    Role.GATE: "model.layers.{i}.mlp.gate_proj.weight",
    Role.UP: "model.layers.{i}.mlp.up_proj.weight",
    Role.DOWN: "model.layers.{i}.mlp.down_proj.weight",
    Role.ROUTER: "model.layers.{i}.mlp.gate.weight",
    Role.EXPERT_GATE: "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
    Role.EXPERT_UP: "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
    Role.EXPERT_DOWN: "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
}


@dataclass(frozen=True, eq=False)
class CanonicalTable:
    """Canonical tensors as columns, index k = `ModelSpec.tensors[k].index`. Shapes are seen as 2-D
    (`rows` x `cols`; a 1-D tensor is one row) because every compiler step works on 2-D boxes. A tensor of more
    dimensions (a depthwise conv1d weight [C, 1, K]) is seen as [prod(leading dims), last dim]: its placements
    cut dim 0 only and keep the middle dimensions whole, so each box stays a rows x cols block of that view."""

    role: np.ndarray  # code into ROLES
    layer: np.ndarray  # -1 where it does not apply
    expert: np.ndarray
    rows: np.ndarray
    cols: np.ndarray
    ndim: np.ndarray

    def __len__(self) -> int:
        return len(self.role)

    @property
    def numel(self) -> np.ndarray:
        return self.rows * self.cols


def _role_shapes(spec: ModelSpec) -> dict[Role, tuple[int, ...]]:
    H, d = spec.hidden_size, spec.head_dim
    F, Fm = spec.intermediate_size, spec.moe_intermediate_size
    return {
        Role.EMBED: (spec.vocab_size, H), Role.LM_HEAD: (spec.vocab_size, H), Role.FINAL_NORM: (H,),
        Role.INPUT_NORM: (H,), Role.POST_ATTN_NORM: (H,), Role.Q_NORM: (d,), Role.K_NORM: (d,),
        Role.Q: (spec.num_attention_heads * d, H), Role.K: (spec.num_key_value_heads * d, H),
        Role.V: (spec.num_key_value_heads * d, H), Role.O: (H, spec.num_attention_heads * d),
        Role.GATE: (F, H), Role.UP: (F, H), Role.DOWN: (H, F), Role.ROUTER: (spec.num_experts, H),
        Role.EXPERT_GATE: (Fm, H), Role.EXPERT_UP: (Fm, H), Role.EXPERT_DOWN: (H, Fm),
    }


@functools.lru_cache(maxsize=64)
def _canonical_table(spec: ModelSpec) -> CanonicalTable:
    """Same order as `_canonical_tensors`, built a layer at a time with numpy."""
    if spec.family not in _TABLE_FAMILIES:
        return _table_from_tensors(_canonical_tensors(spec))
    attn = [Role.INPUT_NORM, Role.Q, Role.K, Role.V, Role.O]
    if spec.qk_norm:
        attn += [Role.Q_NORM, Role.K_NORM]
    attn.append(Role.POST_ATTN_NORM)
    E = spec.num_experts
    expert_roles = np.tile([ROLE_CODE[r] for r in (Role.EXPERT_GATE, Role.EXPERT_UP, Role.EXPERT_DOWN)], E)
    expert_ids = np.repeat(np.arange(E), 3)
    roles, layers, experts = [[ROLE_CODE[Role.EMBED]]], [[-1]], [[-1]]
    for i in range(spec.num_layers):
        head = attn + ([Role.ROUTER] if spec.is_moe_layer(i) else [Role.GATE, Role.UP, Role.DOWN])
        roles.append([ROLE_CODE[r] for r in head])
        experts.append([-1] * len(head))
        if spec.is_moe_layer(i):
            roles.append(expert_roles)
            experts.append(expert_ids)
        layers.append(np.full(len(head) + (3 * E if spec.is_moe_layer(i) else 0), i))
    tail = [Role.FINAL_NORM] + ([] if spec.tie_word_embeddings else [Role.LM_HEAD])
    roles.append([ROLE_CODE[r] for r in tail])
    layers.append([-1] * len(tail))
    experts.append([-1] * len(tail))
    role = np.concatenate([np.asarray(x, dtype=np.int64) for x in roles])
    shapes = _role_shapes(spec)
    by_code = [shapes[r] for r in ROLES]
    nd = np.asarray([len(s) for s in by_code], dtype=np.int64)
    rows = np.asarray([s[0] if len(s) == 2 else 1 for s in by_code], dtype=np.int64)
    cols = np.asarray([s[-1] for s in by_code], dtype=np.int64)
    table = CanonicalTable(role, np.concatenate([np.asarray(x, dtype=np.int64) for x in layers]),
                           np.concatenate([np.asarray(x, dtype=np.int64) for x in experts]),
                           rows[role], cols[role], nd[role])
    for a in (table.role, table.layer, table.expert, table.rows, table.cols, table.ndim):
        a.setflags(write=False)
    return table


@functools.lru_cache(maxsize=64)
def _canonical_tensors(spec: ModelSpec) -> tuple[TensorSpec, ...]:
    """The family (reshard/layouts/families/) lists the tensors; here they get their indices."""
    from .families import family

    rows = family(spec.family).tensors(spec)
    return tuple(TensorSpec(k, *row) for k, row in enumerate(rows))


@functools.lru_cache(maxsize=64)
def _own_dtype_tensors(spec: ModelSpec) -> tuple[TensorSpec, ...]:
    if spec.family in _TABLE_FAMILIES:  # their tensors all have the model's dtype
        return ()
    return tuple(t for t in _canonical_tensors(spec) if t.dtype is not None and t.dtype != spec.dtype)


@functools.lru_cache(maxsize=64)
def _tensors_by_name(spec: ModelSpec) -> dict[str, TensorSpec]:
    return {t.name: t for t in _canonical_tensors(spec)}


def _table_from_tensors(tensors: tuple[TensorSpec, ...]) -> CanonicalTable:
    """The canonical table of a family that lists its tensors (one Python object per tensor)."""
    i64 = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    table = CanonicalTable(i64([role_code(t.role) for t in tensors]), i64([t.layer for t in tensors]),
                           i64([t.expert for t in tensors]),
                           i64([math.prod(t.shape[:-1]) for t in tensors]),
                           i64([t.shape[-1] for t in tensors]), i64([len(t.shape) for t in tensors]))
    for a in (table.role, table.layer, table.expert, table.rows, table.cols, table.ndim):
        a.setflags(write=False)
    return table
