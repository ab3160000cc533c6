"""The Megatron-core source layout, declared by its parallel sizes (the cuts are in `roles.py` and the family files).

Facts it encodes (pinned by the Megatron adapter tests): a layer's tensors live on its pipeline stage (and virtual
chunk `model{c}.`) as `decoder.layers.{index in the chunk}.<name>`; embeddings on the first stage, final norm and
output layer on the last (a tied embedding's copy too, when pp > 1); EP rank r holds experts [r E/ep, (r+1) E/ep),
cut over expert TP; vocab rows are padded to a multiple of `vocab_divisor * tp`; tensors are replicated over (expert)
data parallel ranks; global ranks follow megatron-core's RankGenerator for `rank_order`."""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import StrictInt, StrictStr, model_validator

from ..errors import LimitError
from ..limits import MAX_DIM, MAX_RANKS
from .base import bounded, divisible, pad_to, positive
from .cut_layout import CutLayout, Where
from .cuts import Cut, Group, TensorKind
from .model import TensorSpec
from .roles import kind_of

_AXES = ("tp", "cp", "ep", "dp", "pp")


class MegatronLayout(CutLayout):
    """A megatron-core trainer's layout, declared by its parallel sizes.

    Args:
        model: the model being trained.
        tp: tensor parallel size.
        pp: pipeline parallel size.
        ep: expert parallel size (MoE models).
        etp: expert tensor parallel size; None means `tp`, as in megatron-core.
        world: world size; None means the smallest that fits (data parallel size 1).
        vpp: virtual pipeline chunks per stage.
        first_stage_layers: layers of the first pipeline stage when the split is uneven.
        last_stage_layers: layers of the last pipeline stage when the split is uneven.
        vocab_divisor: vocabulary rows are padded to a multiple of `vocab_divisor * tp`.
        naming: "local" or "te" (TransformerEngine) parameter names.
        rank_order: megatron-core's rank order, first axis fastest (default 'tp-cp-ep-dp-pp').

    Raises:
        LayoutError: sizes that do not divide the model or the world, an unknown rank order or naming.
        LimitError: a size beyond `reshard.limits`.
    """

    engine = "megatron"

    tp: StrictInt = 1
    pp: StrictInt = 1
    ep: StrictInt = 1
    etp: StrictInt | None = None
    world: StrictInt | None = None
    vpp: StrictInt = 1
    first_stage_layers: StrictInt | None = None
    last_stage_layers: StrictInt | None = None
    vocab_divisor: StrictInt = 128
    naming: Literal["local", "te"] = "local"
    rank_order: StrictStr = "tp-cp-ep-dp-pp"

    @model_validator(mode="before")
    @classmethod
    def _fill_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for key in ("tp", "pp", "ep", "etp", "world", "vpp"):
            x = data.get(key)
            if isinstance(x, int) and not isinstance(x, bool) and x > MAX_RANKS:  # before any product of them
                raise LimitError(key, x, MAX_RANKS, "ranks", where=cls.engine)
        # etp and world left out are derived after validation, not among the fields set: model_copy derives them anew
        return {k: v for k, v in data.items() if not (k in ("etp", "world") and v is None)}

    def _derive(self) -> None:
        if self.etp is None:
            self.__dict__["etp"] = self.tp  # the one place a field is written after validation: still building
        if self.world is None:
            dense, expert = self.tp * self.pp, self.etp * self.ep * self.pp
            self.__dict__["world"] = dense * expert // math.gcd(dense, expert) if dense > 0 and expert > 0 else 1

    @model_validator(mode="after")
    def _validate(self) -> "MegatronLayout":
        self._derive()
        m = self.model
        positive(self, tp=self.tp, pp=self.pp, ep=self.ep, etp=self.etp, world=self.world, vpp=self.vpp,
                 vocab_divisor=self.vocab_divisor)
        bounded(self, MAX_RANKS, "ranks", world=self.world)  # the sizes given are bounded in _fill_defaults
        bounded(self, MAX_DIM, "a dimension", vocab_divisor=self.vocab_divisor,
                **{"vocab_divisor * tp": self.vocab_divisor * self.tp})
        divisible(self, "world", self.world, "tp*pp", self.tp * self.pp, blame="what")
        # megatron-core's parallel_state builds the expert grid for every model, dense ones included
        divisible(self, "world", self.world, "etp*ep*pp", self.etp * self.ep * self.pp, blame="what")
        divisible(self, "num_attention_heads", m.num_attention_heads, "tp", self.tp)
        g = m.num_key_value_heads
        if g % self.tp and self.tp % g:  # megatron-core's TransformerConfig rule for num_query_groups
            self._fail(f"num_query_groups (num_key_value_heads)={g} is neither a multiple nor a divisor of "
                       f"tp={self.tp}", tp=self.tp, num_key_value_heads=g)
        qkv_rows = (m.num_attention_heads + 2 * g) * m.head_dim
        divisible(self, "linear_qkv rows (heads + 2 * query_groups) * head_dim", qkv_rows, "tp", self.tp)
        if not m.is_moe or m.dense_layers:
            divisible(self, "ffn_hidden_size", m.intermediate_size, "tp", self.tp)
        if m.is_moe:
            divisible(self, "num_experts", m.num_experts, "ep", self.ep)
            divisible(self, "moe_ffn_hidden_size", m.moe_intermediate_size, "etp", self.etp)
        elif self.ep != 1:  # megatron-core: "num_moe_experts must be non None to use expert-parallel"
            self._fail(f"ep={self.ep} needs a MoE model; {m.family} has no experts",
                       fix="leave ep unset for dense models", ep=self.ep)
        axes = self.rank_order.split("-")
        if sorted(axes) != sorted(_AXES):
            self._fail(f"rank_order={self.rank_order!r} must order each of {'-'.join(_AXES)} exactly once",
                       rank_order=self.rank_order)
        self._stage_layer_counts  # validates the pipeline split
        self._check_cuts()
        return self

    @property
    def num_ranks(self) -> int:
        return self.world

    @property
    def dp(self) -> int:
        """Data-parallel size of the dense layers: world / (tp * pp)."""
        return self.world // (self.tp * self.pp)

    @property
    def edp(self) -> int:
        """Data-parallel size of the experts: world / (etp * ep * pp)."""
        return self.world // (self.etp * self.ep * self.pp)

    @property
    def padded_vocab(self) -> int:
        """Embedding rows as Megatron pads them: vocab_size up to a multiple of vocab_divisor * tp."""
        return pad_to(self.model.vocab_size, self.vocab_divisor * self.tp)

    def __str__(self) -> str:
        extra = "".join(f",{k}={getattr(self, k)}" for k in ("vpp", "first_stage_layers", "last_stage_layers")
                        if getattr(self, k) not in (None, 1))
        return (f"megatron:tp={self.tp},pp={self.pp},ep={self.ep},etp={self.etp},dp={self.dp},"
                f"world={self.world}{extra} [{self.naming} names]")

    @functools.cached_property
    def _stage_layer_counts(self) -> tuple[int, ...]:
        L, p = self.model.num_layers, self.pp
        first, last = self.first_stage_layers, self.last_stage_layers
        if self.vpp > 1:
            if first is not None or last is not None:
                self._fail("first_stage_layers/last_stage_layers cannot be combined with vpp>1",
                           vpp=self.vpp, first_stage_layers=first, last_stage_layers=last)
            if p < 2:
                self._fail(f"vpp={self.vpp} needs pp>=2", vpp=self.vpp, pp=p)
            divisible(self, "num_layers", L, "pp*vpp", p * self.vpp)
            return (L // p,) * p
        if first is None and last is None:
            divisible(self, "num_layers", L, "pp", p)
            return (L // p,) * p
        if p == 1:
            self._fail("first_stage_layers/last_stage_layers need pp>=2", pp=p)
        fixed = [x for x in (first, last) if x is not None]
        if any(x < 1 for x in fixed):
            self._fail("first_stage_layers and last_stage_layers must be at least 1",
                       first_stage_layers=first, last_stage_layers=last)
        middle_stages = p - len(fixed)
        rest = L - sum(fixed)
        if middle_stages == 0:
            if rest != 0:
                self._fail(f"first_stage_layers + last_stage_layers = {sum(fixed)} must equal num_layers={L} "
                           f"when pp=2", num_layers=L)
            return (first, last)
        if rest < middle_stages or rest % middle_stages:
            self._fail(f"the {rest} layers left after first/last stages are not divisible by the "
                       f"{middle_stages} other stages", num_layers=L, first_stage_layers=first,
                       last_stage_layers=last, pp=p)
        each = rest // middle_stages  # p >= 2 here; first and last, where given, are at least 1
        return (first or each, *(each,) * (p - 2), last or each)

    @functools.cached_property
    def _layer_home(self) -> tuple[tuple[int, int, int], ...]:
        """For each global layer: (stage, virtual chunk, index inside that chunk)."""
        L, p, v = self.model.num_layers, self.pp, self.vpp
        if v > 1:  # chunk c holds layers [c L/v, (c+1) L/v), stage s the s-th L/(p v) of them
            per_chunk = L // (p * v)
            return tuple(((i % (L // v)) // per_chunk, i // (L // v), i % per_chunk) for i in range(L))
        return tuple((s, 0, j) for s, n in enumerate(self._stage_layer_counts) for j in range(n))

    def layer_home(self, layer: int) -> tuple[int, int, int]:
        """(pipeline stage, virtual chunk, index inside that chunk's `decoder.layers`) of a global layer."""
        return self._layer_home[layer]

    def _prefix(self, chunk: int) -> str:
        return f"model{chunk}." if self.vpp > 1 else ""

    # a global rank is the sum of coordinate x stride, axes in `rank_order` (first fastest)
    def _sizes(self, expert: bool) -> dict[str, int]:
        return ({"tp": self.etp, "cp": 1, "ep": self.ep, "dp": self.edp, "pp": self.pp} if expert else
                {"tp": self.tp, "cp": 1, "ep": 1, "dp": self.dp, "pp": self.pp})

    def axis_strides(self, expert: bool) -> dict[str, int]:
        """Stride of each parallel axis (of the dense or the expert grid) in the global rank."""
        strides, stride, sizes = {}, 1, self._sizes(expert)
        for axis in self.rank_order.split("-"):
            strides[axis], stride = stride, stride * sizes[axis]
        return strides

    def dense_coords(self, rank: int) -> dict[str, int]:
        """The dense layers' grid coordinates of a global rank: {'tp', 'dp', 'pp'} (and 'cp', 'ep', always 0)."""
        return self._coords(rank, False)

    def expert_coords(self, rank: int) -> dict[str, int]:
        """The experts' grid coordinates of a global rank: {'tp' (expert-TP), 'ep', 'dp' (expert-DP), 'pp'}."""
        return self._coords(rank, True)

    def _coords(self, rank: int, expert: bool) -> dict[str, int]:
        self._check_rank(rank)
        out, sizes = {}, self._sizes(expert)
        for axis in self.rank_order.split("-"):
            out[axis], rank = rank % sizes[axis], rank // sizes[axis]
        return out

    def value_offset(self, tensor: TensorSpec) -> float:
        return kind_of(self.model, tensor.role).megatron_offset

    @functools.cached_property
    def _groups(self) -> tuple[Group, Group]:
        """A dense tensor's group (TP, copied over DP) and an expert's (expert-TP, copied over expert-DP)."""
        d, e = self.axis_strides(False), self.axis_strides(True)
        return (Group(self.engine, self.tp, d["tp"], tuple(k * d["dp"] for k in range(self.dp)), self.padded_vocab),
                Group(self.engine, self.etp, e["tp"], tuple(k * e["dp"] for k in range(self.edp))))

    @functools.cached_property
    def _layers(self) -> "_Layers":
        m = self.model
        return _Layers(np.asarray(self._layer_home, dtype=np.int64).reshape(-1, 3),
                       np.asarray([m.is_moe_layer(i) for i in range(m.num_layers)], dtype=np.int64),
                       [[f"{self._prefix(c)}decoder.layers.{j}." for j in range(m.num_layers)]
                        for c in range(self.vpp)],
                       (self.axis_strides(False), self.axis_strides(True)))

    @property
    def cut_set(self) -> str:
        return "te" if self.naming == "te" else "megatron"

    def _place(self, cut: Cut, kind: TensorKind, layer: np.ndarray | int, expert: np.ndarray | int,
               replica: int | None) -> Where | None:
        g, layers = self._groups[kind.expert], self._layers
        strides = layers.strides[kind.expert]
        if cut.at is not None:  # outside the layers: first or last stage
            if cut.at == "last_copy" and self.pp == 1:
                return None
            stage, chunk = (0, 0) if cut.at == "first" else (self.pp - 1, self.vpp - 1)
            name = self._prefix(chunk) + cut.name
            return Where(g, stage * strides["pp"], (0,), lambda _: name)
        stage, chunk, local = layers.home[layer].T  # one layer or an array of them
        first, j = stage * strides["pp"], 0
        if kind.expert and np.all(np.asarray(expert) < 0):  # one tensor shared by all experts: on every EP rank
            g = dataclasses.replace(g, copies=tuple(c + k * strides["ep"] for k in range(self.ep) for c in g.copies))
        elif kind.expert:
            ep, j = divmod(expert, self.model.num_experts // self.ep)
            first = first + ep * strides["ep"]
            if cut.stacked:  # local expert j is slot j of the rank's stack; the name is the stack's
                g = dataclasses.replace(g, stack=self.model.num_experts // self.ep)
                return Where(g, first, (chunk, local), lambda ch, lo: layers.prefix[ch][lo] + cut.name, j)
        names = (cut.name, cut.moe_name or cut.name)
        return Where(g, first, (chunk, local, layers.moe[layer] if cut.moe_name else 0, j),
                     lambda ch, lo, v, jj: layers.prefix[ch][lo] + names[v].format(j=jj))


@dataclass(frozen=True, eq=False)
class _Layers:
    """Per layer (stage, chunk, index) and MoE flag, name prefixes, axis strides; compared by identity."""

    home: np.ndarray
    moe: np.ndarray
    prefix: list[list[str]]
    strides: tuple[dict[str, int], dict[str, int]]
