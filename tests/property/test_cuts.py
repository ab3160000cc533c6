"""The vocabulary of cuts answers both questions alike: for every cut, the batched rows (many tensors at once)
are the per-tensor placements, row for row and in the same order; and every family's layouts hold their batched
table equal to the reference placements."""
from __future__ import annotations

import glob

import numpy as np
import pytest
from hypothesis import given, reject, strategies as st

from reshard.errors import LayoutError
from reshard.layouts import Layout, MegatronLayout, VllmLayout
from reshard.layouts.base import TableBuilder
from reshard.layouts.cuts import (ColumnBlocks, Cut, GlobalRows, Group, LoraA, LoraB, QkvParallel, Refused,
                                  Replicated, RowBlocks, Stacked, Vocab)
from reshard.layouts.families import discover, read_hf_config
from reshard.layouts.fp8 import ScaledCut
from reshard.testing.strategies import divisors
from harness.layouts import table_rows


def _cuts(draw, tp: int) -> tuple[Cut, tuple[int, ...], int]:
    """A cut of each kind the vocabulary has, with a shape it can cut over `tp` (and the padded vocabulary; for
    the LoRA slot cuts, the group's `lora_rank` and `lora_sharded` are drawn by the caller)."""
    k, m = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    three_d = draw(st.booleans())
    rest = (1, m) if three_d else (m,)
    kind = draw(st.sampled_from([c for c in CUTS if c is not Refused]))  # Refused: its own test below
    if kind is LoraA:
        split = draw(st.booleans())
        return LoraA("w", split_input=split), (k, tp * m if split else m), 0
    if kind is LoraB:
        rows = draw(st.sampled_from([None, RowBlocks("rows"), QkvParallel("rows", tp, tp, 1, 0, alone=True)]))
        return LoraB("w", rows=rows), (tp * k, m), 0
    if kind is Replicated and draw(st.booleans()):  # the whole tensor alone
        return Replicated("w"), draw(st.sampled_from([(k,), (k, m), (k, 1, m)])), 0
    if kind is Replicated:  # at a row of a replicated stack
        row = draw(st.integers(0, 3))
        return Replicated("w", row, row + k + draw(st.integers(0, 2))), (k, *rest), 0
    if kind is Vocab:
        V = draw(st.integers(1, 20))
        return Vocab("w"), (V, m), -(-V // tp) * tp + tp * draw(st.integers(0, 2))
    if kind is RowBlocks:
        parts = draw(st.integers(1, 3))
        return RowBlocks("w", draw(st.integers(0, parts - 1)), parts), (tp * k, *rest), 0
    if kind is ColumnBlocks:
        return ColumnBlocks("w"), (k, tp * m), 0
    if kind is Stacked:
        heads = tuple(draw(st.lists(st.integers(1, 2), min_size=1, max_size=4)))
        sizes = tuple(h * tp * draw(st.integers(1, 2)) for h in heads)
        first = draw(st.integers(0, len(sizes) - 1))
        count = draw(st.integers(1, len(sizes) - first))
        return Stacked("w", sizes, first, count, heads), (sum(sizes[first:first + count]), *rest), 0
    if kind is GlobalRows:
        lengths = draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
        gaps = draw(st.lists(st.integers(0, 2), min_size=len(lengths), max_size=len(lengths)))
        order = draw(st.permutations(range(len(lengths))))
        blocks, at, canon = [], 0, np.cumsum([0, *lengths]).tolist()
        for j in order:  # canonical blocks at global rows in a shuffled order, with gaps between them
            at += gaps[j]
            blocks.append((canon[j], at, lengths[j]))
            at += lengths[j]
        return GlobalRows("w", -(-at // tp) * tp, tuple(blocks)), (canon[-1], m), 0
    if kind is ScaledCut:  # the block scales of a weight cut in whole blocks (layouts.fp8), edge blocks partial
        bn, bk = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        inner = draw(st.sampled_from([RowBlocks("w", 0, 1), ColumnBlocks("w"), Replicated("w")]))
        rows = tp * k * bn if isinstance(inner, RowBlocks) else k * bn - draw(st.integers(0, bn - 1))
        cols = tp * m * bk if isinstance(inner, ColumnBlocks) else m * bk - draw(st.integers(0, bk - 1))
        cut = ScaledCut("s", inner=inner, weight_shape=(rows, cols), block=(bn, bk))
        return cut, (-(-rows // bn), -(-cols // bk)), 0
    heads = draw(st.sampled_from(sorted({tp * x for x in (1, 2)} | set(divisors(tp)))))
    d, part = draw(st.integers(1, 2)), draw(st.integers(0, 2))
    q_rows = tp * draw(st.integers(1, 3))
    alone = draw(st.booleans())
    return (QkvParallel("w", q_rows, heads, d, part, alone=alone), ((q_rows, m) if part == 0 else (heads * d, m)),
            0)


CUTS = (Replicated, Vocab, RowBlocks, ColumnBlocks, Stacked, GlobalRows, QkvParallel, LoraA, LoraB,
        ScaledCut, Refused)


def test_the_property_covers_every_cut():
    assert set(CUTS) == set(Cut.__subclasses__())


@given(st.data())
def test_every_cut_answers_batched_as_per_tensor(data):
    tp = data.draw(st.integers(1, 4))
    cut, shape, vocab = _cuts(data.draw, tp)
    copies = tuple(data.draw(st.lists(st.integers(0, 50), min_size=1, max_size=3, unique=True)))
    stack = data.draw(st.sampled_from([0, 0, 3]))
    lora_rank = tp * data.draw(st.integers(1, 4)) if isinstance(cut, (LoraA, LoraB)) else 0
    g = Group("test", tp, data.draw(st.integers(1, 3)), copies, vocab, stack, data.draw(st.booleans()), lora_rank,
              data.draw(st.booleans()))
    if lora_rank:
        try:
            cut.pieces("w", shape, g)
        except LayoutError:  # the drawn rank exceeds the slot's: refused, as it must be
            reject()
    n = data.draw(st.integers(1, 4))
    first = np.asarray(data.draw(st.lists(st.integers(0, 9), min_size=n, max_size=n)))
    slot = np.asarray(data.draw(st.lists(st.integers(0, max(stack - 1, 0)), min_size=n, max_size=n)))
    names = [f"t{k % 2}" for k in range(n)]  # tensors may share a physical name
    canon = np.arange(n) * 7
    reference = TableBuilder()
    for k in range(n):
        reference.add_placements(int(canon[k]), cut.placements("w", shape, g, names[k], int(first[k]), int(slot[k])))
    batched = TableBuilder()
    cut.add_rows(batched, "w", shape, g, canon, (np.arange(n),), lambda k: names[k], first, slot)
    assert table_rows(batched.table()) == table_rows(reference.table())


@given(st.integers(1, 4), st.integers(0, 3))
def test_a_refused_cut_refuses_both_questions(tp, stack):
    cut, g = Refused("w", reason="no engine cuts it", fix="cut it otherwise"), Group("test", tp, stack=stack)
    with pytest.raises(LayoutError, match="w: no engine cuts it") as e:
        cut.placements("w", (2, 3), g, "w", 0)
    assert e.value.fix == "cut it otherwise"
    with pytest.raises(LayoutError, match="w: no engine cuts it"):
        cut.add_rows(TableBuilder(), "w", (2, 3), g, np.arange(2), (np.arange(2),), str, np.zeros(2, dtype=np.int64))


FAMILY_CONFIGS = sorted(glob.glob("examples/configs/*.json"))


@given(st.data())
def test_family_layouts_batched_equal_reference(data):
    """Every family (its own kinds included), any topology its cuts accept: the batched table is the reference."""
    config = read_hf_config(data.draw(st.sampled_from(FAMILY_CONFIGS)))
    fam = discover(config)
    spec = fam.spec(fam.tiny_config(config))
    tp = data.draw(st.sampled_from([1, 2, 4]))
    try:
        if data.draw(st.booleans()):
            ep = data.draw(st.sampled_from([1, 2])) if spec.is_moe else 1
            layout: Layout = MegatronLayout(model=spec, tp=tp, pp=data.draw(st.sampled_from([1, 2])), ep=ep,
                                            etp=data.draw(st.sampled_from([1, tp])) if spec.is_moe else None,
                                            naming=data.draw(st.sampled_from(["local", "te"])),
                                            vocab_divisor=data.draw(st.sampled_from([1, 8])))
        else:
            layout = VllmLayout(model=spec, tp=tp, replicas=data.draw(st.integers(1, 2)),
                                expert_parallel=spec.is_moe and data.draw(st.booleans()))
    except LayoutError:
        reject()
    index = None
    if data.draw(st.booleans()):
        n = len(spec.canonical)
        index = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=12)))
    replica = data.draw(st.sampled_from([None, 0, layout.num_replicas - 1]))
    reference = Layout.placement_table(layout, index, replica)
    assert sorted(table_rows(layout.placement_table(index, replica))) == sorted(table_rows(reference))
