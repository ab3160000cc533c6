"""Canonical tensors of a model: HF checkpoint names, global shapes and the role each plays.

A family lists a layer's tensors as `Entry`s; the spec expands them into the `CanonicalTable`, one row per tensor.
A role is a shared `Role` or a family's own `cuts.TensorKind`: layouts place a tensor by its role, never its name."""
from __future__ import annotations

import enum
import functools
import json
import math
from dataclasses import dataclass
from typing import Any, Hashable

import numpy as np
from pydantic import (ConfigDict, StrictBool, StrictInt, StrictStr, field_validator,
                      model_validator)

from ..errors import ModelConfigError
from ..limits import MAX_DIM, MAX_EXPERTS, MAX_HEADS, MAX_LAYERS, MAX_PARAMS, MAX_TENSORS, check_limit
from . import registry
from .math_config import math_config
from .validated import ValidatedModel

DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
LAYER = "model.layers.{i}."  # HF (and vLLM) prefix of layer i's tensors
# where a spec keeps its `math` (canonical JSON text): in the instance's __dict__ beside the pydantic fields, which
# pydantic's equality, hash and serialization skip (see ModelSpec.math)
_MATH_KEY = "_reshard_math"


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


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One canonical tensor of a model (its HF checkpoint tensor), as `ModelSpec.tensors` lists them.

    Attributes:
        index: its position in `ModelSpec.tensors`.
        name: the HF checkpoint name.
        shape: the canonical shape.
        role: a shared `Role` or a family's own `cuts.TensorKind` (where each engine keeps it).
        layer: its decoder layer, -1 where none.
        expert: its expert, -1 where none.
        dtype: set only where the tensor keeps another dtype than the model (e.g. a float32 router bias).
    """

    index: int
    name: str
    shape: tuple[int, ...]
    role: Hashable
    layer: int = -1
    expert: int = -1
    dtype: str | None = None

    @property
    def numel(self) -> int:
        """Elements of the tensor."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class Entry:
    """One tensor of a family's list: its HF name (`{i}` the layer, `{e}` the expert), shape and role."""

    name: str
    shape: tuple[int, ...]
    role: Hashable
    dtype: str | None = None  # only where it differs from the model's (a float32 router bias)


@dataclass(frozen=True)
class FusedExperts:
    """One tensor holding some entries of an `Experts` for every expert, as transformers 5 keeps routed experts:
    [count, rows, cols], expert e's slab its `parts` entries stacked on dim 0 (`gate_up_proj` = [gate_e; up_e]).

    Attributes:
        name: the fused tensor's name (`{i}` the layer).
        parts: indexes into `Experts.entries`, in the slab's row order.
    """

    name: str
    parts: tuple[int, ...]


@dataclass(frozen=True)
class Experts:
    """Entries repeated for each of `count` experts, expert by expert (HF's checkpoint order); `fused`: the same
    tensors as exporters may also stream them (`integrations.streams` splits them back)."""

    entries: tuple[Entry, ...]
    count: int
    fused: tuple[FusedExperts, ...] = ()

    def __post_init__(self) -> None:
        for f in self.fused:
            parts = [self.entries[k] for k in f.parts if 0 <= k < len(self.entries)]
            if not parts or len(parts) != len(f.parts) or any(len(e.shape) != 2 for e in parts) or \
                    len({e.shape[1] for e in parts}) != 1:
                raise ModelConfigError(field=f.name, value=f.parts, rule="must name 2-D entries of the experts with "
                                       "the same number of columns (a fused tensor stacks their rows per expert)")


class ModelSpec(ValidatedModel):
    """The facts about a decoder-only transformer that decide where its bytes live.

    Usually made from an HF config with `ModelSpec.from_hf_config(path_or_dict)`. Fields are strictly typed (an
    integer field takes an int, not "64", 64.0 or True) and bounded (`reshard.limits`).

    Args:
        family: the registered family (`qwen3`, `qwen3_moe`, `llama`, `deepseek_v3`, `qwen3_5`, ...).
        hidden_size: model width.
        num_layers: decoder layers.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads.
        head_dim: width of one head.
        intermediate_size: FFN width of dense MLPs.
        vocab_size: vocabulary rows (unpadded).
        tie_word_embeddings: the output layer shares the embedding.
        qk_norm: per-head RMSNorm of queries and keys.
        num_experts: routed experts per MoE layer (0: dense).
        moe_intermediate_size: FFN width of one expert.
        dense_layers: MLP-only layers of a MoE model.
        dtype: parameter dtype.
        arch: family-specific facts as sorted (key, value) pairs (read with `arch_value`).

    A spec made by `from_hf_config` also keeps the config's math-only fields (`math`), outside its fields.

    Raises:
        ModelConfigError: a field of the wrong type, out of its bounds, or breaking the family's rules.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    family: StrictStr
    hidden_size: StrictInt
    num_layers: StrictInt
    num_attention_heads: StrictInt
    num_key_value_heads: StrictInt
    head_dim: StrictInt
    intermediate_size: StrictInt
    vocab_size: StrictInt
    tie_word_embeddings: StrictBool = False
    qk_norm: StrictBool = False
    num_experts: StrictInt = 0
    moe_intermediate_size: StrictInt = 0
    dense_layers: tuple[StrictInt, ...] = ()
    dtype: StrictStr = "bfloat16"
    arch: tuple[tuple[str, Any], ...] = ()  # sorted pairs: the spec stays hashable and JSON round-trips

    @field_validator("arch", mode="before")
    @classmethod
    def _freeze_arch(cls, value: Any) -> tuple[tuple[str, Any], ...]:
        if not isinstance(value, (dict, list, tuple)):
            raise ModelConfigError(field="arch", value=value, rule="must be a mapping of family facts")
        items = value.items() if isinstance(value, dict) else value
        if isinstance(value, dict) and not all(isinstance(k, str) for k in value):
            raise ModelConfigError(field="arch", value=value, rule="must have string keys (family fact names)")
        try:
            return tuple(sorted((str(k), frozen(v)) for k, v in items))
        except (TypeError, ValueError):
            raise ModelConfigError(field="arch", value=value, rule="must be (key, value) pairs of JSON values") \
                from None

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        bounds = {"hidden_size": MAX_DIM, "num_layers": MAX_LAYERS, "num_attention_heads": MAX_HEADS,
                  "num_key_value_heads": MAX_HEADS, "head_dim": MAX_DIM, "intermediate_size": MAX_DIM,
                  "vocab_size": MAX_DIM, "num_experts": MAX_EXPERTS, "moe_intermediate_size": MAX_DIM}
        for field, limit in bounds.items():
            value, least = getattr(self, field), 0 if field in ("intermediate_size", "num_experts",
                                                                 "moe_intermediate_size") else 1
            if value < least:
                raise ModelConfigError(field=field, value=value, rule="must be >= 0" if least == 0 else
                                       "must be positive", fix="leave it unset for MHA" if "key_value" in field else "")
            check_limit(field, value, limit, "layers" if field == "num_layers" else "experts"
                        if field == "num_experts" else "heads" if "heads" in field else "a dimension", "model spec")
        check_limit("num_attention_heads * head_dim", self.num_attention_heads * self.head_dim, MAX_DIM,
                    "a dimension", "model spec")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(field="num_key_value_heads", value=self.num_key_value_heads,
                                   rule=f"does not divide num_attention_heads={self.num_attention_heads}")
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise ModelConfigError(field="moe_intermediate_size", value=self.moe_intermediate_size,
                                   rule=f"must be > 0 in a MoE model (num_experts={self.num_experts})")
        if (not self.num_experts or self.dense_layers) and self.intermediate_size <= 0:
            raise ModelConfigError(field="intermediate_size", value=self.intermediate_size,
                                   rule="must be > 0: the model has dense MLP layers")
        if self.dtype not in DTYPE_SIZES:
            raise ModelConfigError(field="dtype", value=self.dtype, rule=f"is not one of {sorted(DTYPE_SIZES)}")
        bad = sorted({i for i in self.dense_layers if not 0 <= i < self.num_layers})
        if bad:
            raise ModelConfigError(field="dense_layers", value=list(self.dense_layers),
                                   rule=f"lists layers {bad[:5]} outside [0, {self.num_layers})")
        if len(set(self.dense_layers)) != len(self.dense_layers):
            raise ModelConfigError(field="dense_layers", value=list(self.dense_layers), rule="lists a layer twice")
        registry.family(self.family)  # refuses a family not registered
        # a bound on the tensor count before the family lists them, then the exact sizes (Python integers)
        check_limit("num_layers * (3 * num_experts + 64) (canonical tensors)",
                    self.num_layers * (3 * self.num_experts + 64), MAX_TENSORS, "canonical tensors", "model spec")
        _check_sizes(self)
        return self

    def arch_value(self, key: str, default: Any = None) -> Any:
        """The family-specific fact `key` of `arch`, else `default`."""
        return dict(self.arch).get(key, default)

    @property
    def math(self) -> dict[str, Any] | None:
        """The HF config's math-only fields (`layouts.math_config`) as JSON values, for a spec made by
        `from_hf_config`; None otherwise. Not a field: equality, `model_dump` and digests ignore it, so a spec
        equals the engine's own; `model_copy` keeps it, `ModelSpec(**spec.model_dump())` does not."""
        raw = self.__dict__.get(_MATH_KEY)
        return None if raw is None else json.loads(raw)

    def _with_math(self, fields: "dict[str, Any] | None") -> "ModelSpec":
        """This spec, carrying `fields` (None: none) as its `math`, stored as canonical JSON text."""
        if fields is None:
            self.__dict__.pop(_MATH_KEY, None)
        else:
            self.__dict__[_MATH_KEY] = json.dumps(fields, sort_keys=True)
        return self

    def model_copy(self, *, update: Any = None, deep: bool = False) -> "ModelSpec":  # type: ignore[override]
        """A copy with `update` applied, validated (`ValidatedModel.model_copy`), keeping this spec's `math`."""
        return super().model_copy(update=update, deep=deep)._with_math(self.math)

    @property
    def is_moe(self) -> bool:
        """Whether the model has routed experts."""
        return self.num_experts > 0

    @property
    def itemsize(self) -> int:
        """Bytes per element of `dtype`."""
        return DTYPE_SIZES[self.dtype]

    @property
    def own_dtype_tensors(self) -> tuple[TensorSpec, ...]:
        """The canonical tensors kept in another dtype than the model's (DeepSeek-V3's float32 router bias)."""
        return _own_dtype_tensors(self)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer` routes to experts (a MoE model's layers but `dense_layers`)."""
        return self.is_moe and layer not in self.dense_layers

    @property
    def tensors(self) -> tuple[TensorSpec, ...]:
        """Every canonical tensor, in index order."""
        return _canonical_tensors(self)

    def tensor(self, name: str) -> TensorSpec:
        """The canonical tensor called `name` (its HF name); KeyError where none is."""
        by_name = _tensors_by_name(self)
        if name not in by_name:
            raise KeyError(f"{name!r} is not a tensor of this {self.family} model")
        return by_name[name]

    @property
    def canonical(self) -> "CanonicalTable":
        """The canonical tensors as arrays (same order as `tensors`), without a Python object per tensor."""
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
        """Elements of all canonical tensors."""
        return int(self.canonical.numel.sum())

    @property
    def num_bytes(self) -> int:
        """Bytes of all canonical tensors, each element counted at `itemsize`."""
        return self.num_params * self.itemsize

    def __str__(self) -> str:
        moe = f", {self.num_experts} experts x {self.moe_intermediate_size}" if self.is_moe else ""
        return (f"{self.family}(L={self.num_layers}, H={self.hidden_size}, heads={self.num_attention_heads}/"
                f"{self.num_key_value_heads}x{self.head_dim}, F={self.intermediate_size}{moe}, "
                f"V={self.vocab_size}, {self.num_params / 1e9:.2f}B params)")

    @classmethod
    def from_hf_config(cls, config: "dict | str", include_mtp: bool = False) -> "ModelSpec":
        """The spec of an HF `config.json` (a path or its parsed dict), by the family its architecture names.

        Args:
            config: a path to config.json (or its folder), or the parsed dict (untrusted: validated strictly).
            include_mtp: also plan DeepSeek-V3's multi-token-prediction layers.

        Returns:
            The validated spec.

        Raises:
            ModelConfigError: an unreadable or invalid config, or an architecture no family claims.
            ArgumentError: `include_mtp` is not a bool.
        """
        config = registry.read_hf_config(config)  # read once: the spec and its math come from the same dict
        spec = registry.spec_from_hf_config(config, include_mtp=include_mtp)
        # a fresh object (a family may hand out cached specs): its math belongs to this config alone
        return spec.model_copy()._with_math(math_config(config))


def frozen(value: Any) -> Any:
    """`value` hashable: lists as tuples, dicts as sorted (key, value) pairs, all the way down."""
    if isinstance(value, (list, tuple)):
        return tuple(frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), frozen(v)) for k, v in value.items()))
    return value


@dataclass(frozen=True, eq=False)
class CanonicalTable:
    """Canonical tensors as columns, index k = `ModelSpec.tensors[k].index`, shapes seen as 2-D (`rows` x
    `cols`; a 1-D tensor is one row; an N-D one [prod(leading dims), last dim], its cuts splitting dim 0 only)."""

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
        """Elements per tensor."""
        return self.rows * self.cols


@functools.lru_cache(maxsize=64)
def _canonical_table(spec: ModelSpec) -> CanonicalTable:
    """The family's entries, layer by layer (a layer's list is expanded once per distinct list)."""
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
            empty = [np.zeros(0, dtype=np.int64)]  # a family without head or tail tensors (an adapter)
            expanded[items] = (np.concatenate(entry + empty), np.concatenate(expert + empty))
        return expanded[items]

    def transformed(items: Any, layer: int) -> tuple:
        items = tuple(items)
        for transform in registry.entry_transforms():  # e.g. an FP8 wire spec's fp8 + scales (layouts.fp8)
            items = transform(spec, items, layer)
        return items

    blocks = [(expand(transformed(items, i)), i) for items, i in entry_lists(spec)]
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


def entry_lists(spec: ModelSpec) -> list[tuple[Any, int]]:
    """The family's lists of `spec`'s entries with their layer: head (-1), each layer, tail (-1)."""
    fam = registry.family(spec.family)
    return [(fam.head(spec), -1), *((fam.layer(spec, i), i) for i in range(spec.num_layers)), (fam.tail(spec), -1)]


def _check_sizes(spec: ModelSpec) -> None:
    """Refuse a spec its family cannot lay out, a non-positive or unbounded shape, or too many parameters."""
    try:
        c = _canonical_table(spec)
    except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError) as e:
        raise ModelConfigError(field="arch", value=dict(spec.arch), rule=f"the {spec.family} family cannot lay "
                               f"out this spec ({type(e).__name__}: {e})") from None
    counts = np.bincount(c.entry, minlength=len(c.entries)).tolist()
    total = 0
    for e, n in zip(c.entries, counts):
        if any(not isinstance(x, int) or x <= 0 for x in e.shape):
            raise ModelConfigError(field=e.name, value=e.shape, rule="has a dimension that is not positive")
        for x in e.shape:
            check_limit(f"a dimension of {e.name}", x, MAX_DIM, "a dimension", "model spec")
        total += math.prod(e.shape) * n
    check_limit("parameters", total, MAX_PARAMS, "parameters of one model", "model spec")


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
