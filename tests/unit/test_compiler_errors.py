"""The vectorized compiler still refuses inconsistent layouts, naming what is wrong."""
from __future__ import annotations

from typing import ClassVar

import pytest

import reshard
from reshard.errors import CoverageError, PlanError
from reshard.layouts import Layout, Placement, TensorSpec

MODEL = reshard.ModelSpec(family="qwen3", hidden_size=8, num_layers=1, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=4, intermediate_size=8, vocab_size=16, qk_norm=True, dtype="float32")


class Skewed(Layout):
    """One rank holding every tensor whole, except that `mode` breaks the embedding's placements."""

    engine: ClassVar[str] = "skewed"
    mode: str = "ok"

    @property
    def num_ranks(self) -> int:
        return 1

    def placements(self, tensor: TensorSpec, replica: int | None = None) -> list[Placement]:
        zero = (0,) * len(tensor.shape)
        whole = Placement(0, tensor.name, tensor.shape, zero, tensor.shape, zero)
        if tensor.name != "model.embed_tokens.weight" or self.mode == "ok":
            return [whole]
        V, H = tensor.shape
        if self.mode == "overlap":  # two different boxes sharing rows
            return [Placement(0, "a", (V, H), (0, 0), (V // 2 + 1, H), (0, 0)),
                    Placement(0, "b", (V, H), (V // 2, 0), (V // 2, H), (0, 0))]
        if self.mode == "outside":
            return [Placement(0, "a", (V + 4, H), (0, 0), (V + 4, H), (0, 0))]
        if self.mode == "hole":  # the last rows are held nowhere
            return [Placement(0, "a", (V, H), (0, 0), (V - 2, H), (0, 0))]
        if self.mode == "two shapes":
            return [Placement(0, "a", (V, H), (0, 0), (V // 2, H), (0, 0)),
                    Placement(0, "a", (V // 2, H), (V // 2, 0), (V // 2, H), (0, 0))]
        raise AssertionError(self.mode)

    def rank_tensors(self, rank: int) -> dict[str, tuple[int, ...]]:
        return {}


DST = reshard.VllmLayout(model=MODEL, tp=2)


@pytest.mark.parametrize("mode,error,words", [
    ("overlap", PlanError, "overlapping but different boxes of model.embed_tokens.weight"),
    ("outside", PlanError, "outside model.embed_tokens.weight"),
    ("hole", CoverageError, "model data not (wholly) written"),
    ("two shapes", PlanError, "two shapes"),
])
def test_inconsistent_source_layouts_are_refused(mode, error, words):
    with pytest.raises(error) as info:
        reshard.compile(Skewed(model=MODEL, mode=mode), DST)
    assert words in str(info.value)


def test_consistent_custom_layout_compiles():
    plan = reshard.compile(Skewed(model=MODEL), DST)
    assert plan.accounting.total_bytes == plan.accounting.lower_bound_bytes


def test_roots_without_fanout_and_bad_ranks_are_refused():
    src = Skewed(model=MODEL)
    with pytest.raises(PlanError, match="roots=2 needs fanout"):
        reshard.compile(src, DST, roots=2)
    with pytest.raises(PlanError, match="roots=5"):
        reshard.compile(src, reshard.VllmLayout(model=MODEL, tp=2, replicas=3), fanout=2, roots=5)
    plan = reshard.compile(src, DST)
    with pytest.raises(PlanError, match="destination rank 9"):
        plan.ops_received_by(9)
    with pytest.raises(PlanError, match="source rank 3"):
        plan.ops_sent_by(3)
