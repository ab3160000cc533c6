"""The vLLM destination layout, declared by its parallel sizes (the cuts are in `roles.py` and the family files).

Facts it encodes (pinned by the vLLM adapter tests): experts are stacked [E_local, ...] per rank, each cut over
TP, or, with expert parallelism, whole with rank r holding experts [r E/tp, (r+1) E/tp); with EPLB rank r holds
physical slots [r P/tp, (r+1) P/tp) of P = E + redundant_experts, each the logical expert the `ExpertPlacement`
names; vocab rows are padded to a multiple of `vocab_padding`, then split over TP; replica k's rank r is global
rank r + k*tp."""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np
from pydantic import StrictBool, StrictInt, model_serializer, model_validator

from ..limits import MAX_DIM, MAX_EXPERTS, MAX_RANKS
from .base import bounded, divisible, pad_to, positive
from .cut_layout import CutLayout, Where
from .cuts import Cut, Group, TensorKind
from .expert_placement import ExpertPlacement, slot_index
from .roles import kind_of


class ExpertStacks(NamedTuple):
    """The stacked expert tensors of one replica's ranks, for the planner's slot proof: tensor k is `names[k]` on
    rank `ranks[k]`, of layer `layers[k]`; its slot j holds logical expert `logical[k, j]`."""

    ranks: np.ndarray
    names: tuple[str, ...]
    layers: np.ndarray
    logical: np.ndarray  # [tensors, slots per rank]


class VllmLayout(CutLayout):
    """vLLM engines' layout, declared by their parallel sizes (the module docstring lists the facts).

    Args:
        model: the served model.
        tp: tensor parallel size of each engine.
        replicas: identical engines (replica k's rank r is global rank r + k * tp).
        expert_parallel: experts whole, spread over the TP ranks (vLLM's `enable_expert_parallel`).
        vocab_padding: vocabulary rows are padded to a multiple of this before the TP split.
        redundant_experts: EPLB's redundant experts (vLLM's `num_redundant_experts`).
        expert_placement: the engine's current placement of logical experts in physical slots (from its EPLB
            state); None (also stored for one equal to it): vLLM's initial placement.

    Raises:
        LayoutError: sizes that do not divide the model, or an expert placement that is not this engine's.
        ArgumentError: an expert placement that is not a permutation with replicas (`ExpertPlacement`).
        LimitError: a size beyond `reshard.limits`.
    """

    engine = "vllm"
    installs = ("direct", "loader")

    tp: StrictInt = 1
    replicas: StrictInt = 1
    expert_parallel: StrictBool = False
    vocab_padding: StrictInt = 64
    redundant_experts: StrictInt = 0
    expert_placement: ExpertPlacement | None = None

    @model_validator(mode="wrap")
    @classmethod
    def _canonical_experts(cls, data: Any, handler: Any) -> "VllmLayout":
        """One layout, one value: a placement fills in `redundant_experts`; vLLM's initial one is stored as None."""
        if isinstance(data, dict) and data.get("expert_placement") is not None and "redundant_experts" not in data:
            placement = data["expert_placement"]
            if not isinstance(placement, ExpertPlacement):
                placement = ExpertPlacement.model_validate(placement)
            data = {**data, "expert_placement": placement, "redundant_experts": placement.redundant}
        layout = handler(data)
        p = layout.expert_placement
        if p is not None and p.is_initial:
            fields = {k: getattr(layout, k) for k in layout.model_fields_set}
            return handler({**fields, "expert_placement": None})
        return layout

    @model_serializer(mode="wrap")
    def _without_eplb_defaults(self, handler: Any) -> dict[str, Any]:
        """The EPLB fields appear only when set (a layout without them keeps its old JSON form and digests)."""
        out = handler(self)
        if isinstance(out, dict):
            if out.get("redundant_experts") == 0:
                out.pop("redundant_experts")
            if out.get("expert_placement", 0) is None:
                out.pop("expert_placement")
        return out

    @model_validator(mode="after")
    def _validate(self) -> "VllmLayout":
        m = self.model
        positive(self, tp=self.tp, replicas=self.replicas, vocab_padding=self.vocab_padding)
        if self.redundant_experts < 0:
            self._fail(f"redundant_experts={self.redundant_experts} must be at least 0",
                       redundant_experts=self.redundant_experts)
        bounded(self, MAX_EXPERTS, "experts", redundant_experts=self.redundant_experts)
        bounded(self, MAX_RANKS, "ranks", tp=self.tp, replicas=self.replicas,
                **{"tp * replicas": self.tp * self.replicas})
        bounded(self, MAX_DIM, "a dimension", vocab_padding=self.vocab_padding)
        divisible(self, "num_attention_heads", m.num_attention_heads, "tp", self.tp)
        g = m.num_key_value_heads
        if self.tp >= g:
            divisible(self, "tp", self.tp, "num_key_value_heads", g, blame="what")
        else:
            divisible(self, "num_key_value_heads", g, "tp", self.tp)
        if not m.is_moe or m.dense_layers:
            divisible(self, "intermediate_size", m.intermediate_size, "tp", self.tp)
        if m.is_moe:
            if self.expert_parallel:
                self._check_experts()
            else:
                divisible(self, "moe_intermediate_size", m.moe_intermediate_size, "tp", self.tp)
        elif self.expert_parallel:
            self._fail(f"expert_parallel=True needs a MoE model; {m.family} has no experts",
                       expert_parallel=True)
        if not (self.expert_parallel and m.is_moe) and (self.redundant_experts or self.expert_placement):
            self._fail("redundant experts and expert placements need expert_parallel=True on a MoE model (vLLM's "
                       "EPLB runs only with expert parallelism)", redundant_experts=self.redundant_experts)
        divisible(self, "padded_vocab", self.padded_vocab, "tp", self.tp)
        self._check_cuts()
        return self

    def _check_experts(self) -> None:
        """Expert parallel: the physical slots split evenly over the EP ranks; a placement must be this engine's."""
        m, R, p = self.model, self.redundant_experts, self.expert_placement
        divisible(self, "num_experts + redundant_experts" if R or p else "num_experts", m.num_experts + R,
                  "tp (expert parallel size)", self.tp, blame="tp")
        if p is None:
            return
        moe_layers = len(moe_layer_numbers(m))
        problems = [f"{what}: the placement's {got}, the layout's {want}" for what, got, want in (
            ("logical experts", p.logical_experts, m.num_experts), ("EP ranks", p.ranks, self.tp),
            ("redundant experts", p.redundant, R)) if got != want]
        if p.num_rows not in (1, moe_layers):
            problems.append(f"MoE layers: the placement has {p.num_rows} rows, the model {moe_layers} MoE layers "
                            f"(one row stands for all)")
        if problems:
            self._fail(f"expert_placement ({p.digest[:12]}) is not this engine's: " + "; ".join(problems),
                       "read the placement from the engine's EPLB state (ExpertPlacement.from_vllm) for this model "
                       "and EP size", expert_placement=p.digest[:12])

    @property
    def experts(self) -> ExpertPlacement | None:
        """The declared `expert_placement`, else vLLM's initial one (expert parallel only; None otherwise)."""
        if not (self.expert_parallel and self.model.is_moe):
            return None
        if self.expert_placement is not None:
            return self.expert_placement
        return ExpertPlacement.initial(self.model.num_experts, self.redundant_experts, self.tp)

    def with_initial_experts(self) -> "VllmLayout":
        """This layout with vLLM's initial expert placement: what the engine's weight loaders write."""
        return self if self.expert_placement is None else self.model_copy(update={"expert_placement": None})

    def expert_stacks(self, replica: int = 0) -> ExpertStacks | None:
        """`replica`'s stacked expert tensors and each slot's logical expert, read off the placement (EP only)."""
        p = self.experts
        if p is None:
            return None
        names: list[str] = []  # the stacked expert tensors of one MoE layer, as the cuts name them
        for kind in dict.fromkeys(kind_of(self.model, e.role) for e in self.model.canonical.entries):
            names += [c.name for c in (self._cuts(kind) if kind.expert else ()) if c.name not in names]
        S, layers = p.slots_per_rank, moe_layer_numbers(self.model)
        per = np.broadcast_to(p.table(), (len(layers), p.num_physical)).reshape(len(layers), self.tp, 1, S)
        logical = np.broadcast_to(per, (len(layers), self.tp, len(names), S)).reshape(-1, S)
        ranks = np.tile(np.repeat(np.arange(self.tp, dtype=np.int64), len(names)), len(layers)) + replica * self.tp
        layer_col = np.repeat(np.asarray(layers, dtype=np.int64), self.tp * len(names))
        named = tuple(self.name_prefix + n.format(i=i) for i in layers for _ in range(self.tp) for n in names)
        return ExpertStacks(ranks, named, layer_col, logical)

    def _slots(self, layer: np.ndarray | int, expert: np.ndarray | int) -> tuple[np.ndarray, np.ndarray]:
        """(which tensor, physical slot) of every copy of the expert tensors at `layer` / `expert`, in order."""
        p = self.experts
        layer, expert = (np.asarray(x, dtype=np.int64).reshape(-1) for x in np.broadcast_arrays(layer, expert))
        order, start, count = slot_index(p)
        row = np.zeros_like(layer) if p.num_rows == 1 else np.searchsorted(moe_layer_numbers(self.model), layer)
        n = count[row, expert]
        which = np.repeat(np.arange(len(layer)), n)
        within = np.arange(len(which)) - np.repeat(np.cumsum(n) - n, n)
        return which, order[row[which], start[row, expert][which] + within]

    @property
    def num_ranks(self) -> int:
        return self.tp * self.replicas

    @property
    def num_replicas(self) -> int:
        return self.replicas

    @property
    def padded_vocab(self) -> int:
        """Embedding rows as vLLM pads them: vocab_size up to a multiple of vocab_padding."""
        return pad_to(self.model.vocab_size, self.vocab_padding)

    @property
    def name_prefix(self) -> str:
        """Prepended to every parameter name (`language_model.` where a multimodal wrapper nests the model)."""
        return self.model.arch_value("vllm_prefix", "")

    def __str__(self) -> str:
        ep = ",ep" if self.expert_parallel else ""
        redundant = f",redundant_experts={self.redundant_experts}" if self.redundant_experts else ""
        placed = f",placement={self.expert_placement.digest[:12]}" if self.expert_placement is not None else ""
        return f"vllm:tp={self.tp},replicas={self.replicas}{ep}{redundant}{placed}"

    def _group(self, expert: bool, replica: int | None) -> Group:
        """Replica 0's TP ranks, copied to each replica (or to `replica` only); experts stack per rank."""
        copies = tuple(k * self.tp for k in (range(self.replicas) if replica is None else (replica,)))
        E = self.model.num_experts
        if not expert:
            return Group(self.engine, self.tp, 1, copies, self.padded_vocab, copies_first=True)
        if self.expert_parallel:  # whole experts, P / tp physical slots per rank (P = E without EPLB)
            return Group(self.engine, 1, 1, copies, stack=(E + self.redundant_experts) // self.tp, copies_first=True)
        return Group(self.engine, self.tp, 1, copies, stack=E, copies_first=True)

    def _place(self, cut: Cut, kind: TensorKind, layer: np.ndarray | int, expert: np.ndarray | int,
               replica: int | None) -> Where | None:
        g, name = self._group(kind.expert, replica), self.name_prefix + cut.name
        expert = expert if cut.expert is None else cut.expert  # a shared tensor's copy for expert cut.expert
        first, slot = 0, expert  # every tensor's group starts at rank 0 of its replica
        if kind.expert and self.expert_parallel:
            if self.redundant_experts or self.expert_placement is not None:  # EPLB: a copy in each of its slots
                which, physical = self._slots(layer, expert)
                first, slot = np.divmod(physical, g.stack)
                return Where(g, first, (np.asarray(layer).reshape(-1)[which] if np.ndim(layer) else layer,),
                             lambda i: name.format(i=i), slot, which)
            first, slot = divmod(expert, g.stack)  # linear: expert e in slot e of P = E
        return Where(g, first, (layer,), lambda i: name.format(i=i), slot)


@functools.lru_cache(maxsize=32)
def moe_layer_numbers(model: Any) -> tuple[int, ...]:
    """The model's MoE layers, in order: what vLLM's EPLB numbers 0, 1, ... (its `moe_layer_idx`)."""
    return tuple(i for i in range(model.num_layers) if model.is_moe_layer(i))
