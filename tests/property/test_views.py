"""Bound copy programs (prebuilt views, widened to words where alignment allows) copy exactly what the plain
program runner copies, for random blocks, offsets and element sizes."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, strategies as st

from reshard.executors.copies import DST, SRC, Memory, fold, view_copies, word_elements
from harness.loopback import run_copies

DTYPES = {2: torch.bfloat16, 4: torch.float32}


@st.composite
def programs(draw):
    itemsize = draw(st.sampled_from([2, 4]))
    size = 4096
    blocks, taken = [], np.zeros(size, dtype=bool)
    for _ in range(draw(st.integers(1, 12))):
        rows = draw(st.integers(1, 6))
        cols = draw(st.sampled_from([1, 3, 4, 8, 12, 16]))
        d_stride = cols + draw(st.sampled_from([0, 0, 4, 5]))
        s_stride = cols + draw(st.sampled_from([0, 4, 7]))
        d_off = draw(st.integers(0, size - rows * d_stride)) // draw(st.sampled_from([1, 4])) * \
            draw(st.sampled_from([1, 4]))
        d_off = min(d_off, size - rows * d_stride)
        cells = (d_off + np.arange(rows)[:, None] * d_stride + np.arange(cols)[None, :]).ravel()
        if taken[cells].any():
            continue  # destination blocks never overlap
        taken[cells] = True
        s_off = draw(st.integers(0, size - rows * s_stride))
        blocks.append((s_off, s_stride, d_off, d_stride, rows, cols))
    return itemsize, blocks, draw(st.sampled_from([0, 1, 4]))


@given(programs())
def test_bound_program_copies_like_the_plain_runner(case):
    itemsize, blocks, shift = case
    so, ss, do, ds, rows, cols = (np.array(x) for x in zip(*blocks))
    prog = fold(SRC, 0, so, ss, DST, 0, do, ds, rows, cols)
    dtype = DTYPES[itemsize]
    base = torch.randn(4096 + shift).to(dtype)
    src = base[shift:]  # a misaligned start disables word views for the source
    want, got = torch.zeros(4096, dtype=dtype), torch.zeros(4096, dtype=dtype)
    run_copies(prog.rows_as_lists(), lambda kind, i: src if kind == SRC else want)
    view_copies(prog, Memory(lambda kind, i: src if kind == SRC else got, itemsize), itemsize).run()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert (word_elements(prog, itemsize) >= 1).all()


def test_large_contiguous_copies_run_alone():
    n = (1 << 20) // 2 + 8  # a bit over 1 MiB of bf16
    src = torch.randn(2 * n).to(torch.bfloat16)
    got = torch.zeros(2 * n, dtype=torch.bfloat16)
    prog = fold(SRC, 0, np.array([0, n + 8]), n, DST, 0, np.array([n, 0]), n, 1, np.array([n, 64]))
    bound = view_copies(prog, Memory(lambda kind, i: src if kind == SRC else got, 2), 2)
    assert len(bound.large) == 1 and sum(len(g[0]) for g in bound.groups) == 1
    bound.run()
    assert torch.equal(got[n:], src[:n]) and torch.equal(got[:64], src[n + 8:n + 72])
