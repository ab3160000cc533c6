"""The vLLM destination layout, declared by its parallel sizes; what each tensor's cuts are is in `roles.py`
(shared roles) and the family files.

Facts this encodes (pinned by the vLLM adapter tests against real vLLM):
- experts (`mlp.experts.routed_experts.*` in vLLM) are stacked [E_local, ...] per rank: without expert
  parallel every rank holds all experts, each cut over TP; with it an expert is whole (tp_moe = 1) and rank r
  holds experts [r E/tp, (r+1) E/tp);
- vocab rows are padded to a multiple of `vocab_padding` (64) and then split evenly over TP; padding rows are
  not model data and are left alone;
- replicas are independent engines with identical layouts; replica k's rank r is global rank r + k*tp.
"""
from __future__ import annotations

import numpy as np
from pydantic import StrictBool, StrictInt, model_validator

from ..limits import MAX_DIM, MAX_RANKS
from .base import bounded, divisible, pad_to, positive
from .cut_layout import CutLayout, Where
from .cuts import Cut, Group, Kind


class VllmLayout(CutLayout):
    """vLLM engines' layout, declared by their parallel sizes (the module docstring lists the facts).

    Args:
        model: the served model.
        tp: tensor parallel size of each engine.
        replicas: identical engines (replica k's rank r is global rank r + k * tp).
        expert_parallel: experts whole, spread over the TP ranks (vLLM's `enable_expert_parallel`).
        vocab_padding: vocabulary rows are padded to a multiple of this before the TP split.

    Raises:
        LayoutError: sizes that do not divide the model (heads, KV heads, FFN, experts).
        LimitError: a size beyond `reshard.limits`.
    """

    kind = "vllm"

    tp: StrictInt = 1
    replicas: StrictInt = 1
    expert_parallel: StrictBool = False
    vocab_padding: StrictInt = 64

    @model_validator(mode="after")
    def _validate(self) -> "VllmLayout":
        m = self.model
        positive(self, tp=self.tp, replicas=self.replicas, vocab_padding=self.vocab_padding)
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
                divisible(self, "num_experts", m.num_experts, "tp (expert parallel size)", self.tp, blame="tp")
            else:
                divisible(self, "moe_intermediate_size", m.moe_intermediate_size, "tp", self.tp)
        elif self.expert_parallel:
            self._fail(f"expert_parallel=True needs a MoE model; {m.family} has no experts",
                       expert_parallel=True)
        divisible(self, "padded_vocab", self.padded_vocab, "tp", self.tp)
        self._check_cuts()
        return self

    @property
    def num_ranks(self) -> int:
        return self.tp * self.replicas

    @property
    def num_replicas(self) -> int:
        return self.replicas

    @property
    def padded_vocab(self) -> int:
        return pad_to(self.model.vocab_size, self.vocab_padding)

    @property
    def name_prefix(self) -> str:
        """Prepended to every parameter name: a multimodal wrapper nests the language model (e.g.
        `language_model.` for vLLM's Qwen3.5 ForConditionalGeneration); the family sets it in the spec."""
        return self.model.arch_value("vllm_prefix", "")

    def __str__(self) -> str:
        ep = ",ep" if self.expert_parallel else ""
        return f"vllm:tp={self.tp},replicas={self.replicas}{ep}"

    def _group(self, expert: bool, replica: int | None) -> Group:
        """Replica 0's TP ranks, copied to each replica (or to `replica` only); experts stack per rank."""
        copies = tuple(k * self.tp for k in (range(self.replicas) if replica is None else (replica,)))
        E = self.model.num_experts
        if not expert:
            return Group(self.kind, self.tp, 1, copies, self.padded_vocab, copies_first=True)
        if self.expert_parallel:
            return Group(self.kind, 1, 1, copies, stack=E // self.tp, copies_first=True)
        return Group(self.kind, self.tp, 1, copies, stack=E, copies_first=True)

    def _cuts(self, kind: Kind) -> tuple[Cut, ...]:
        return kind.vllm

    def _place(self, cut: Cut, kind: Kind, layer: np.ndarray | int, expert: np.ndarray | int,
               replica: int | None) -> Where | None:
        g, name = self._group(kind.expert, replica), self.name_prefix + cut.name
        expert = expert if cut.expert is None else cut.expert  # a shared tensor's copy for expert cut.expert
        first, slot = 0, expert  # every tensor's group starts at rank 0 of its replica
        if kind.expert and self.expert_parallel:
            first, slot = divmod(expert, g.stack)
        return Where(g, first, (layer,), lambda i: name.format(i=i), slot)
