"""The one-launch quantizer's block table (kernels.fp8_blocks), property-tested in numpy without Triton: for random
jobs (shapes, block shapes, row strides, scale layouts, places in memory), applying the table quantizes exactly
the blocks a per-job walk over 2-D views finds, writes nothing else, and the alignment it reports holds for every
row. The kernel itself is tested byte for byte in test_kernels.py (interpreter) and on the GPU."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.lib.stride_tricks import as_strided

from reshard.kernels.fp8_blocks import aligned, block_rows, table


def apply_table(rows: np.ndarray, x: np.ndarray, q: np.ndarray, s: np.ndarray, quantize) -> None:
    """What the kernel does, over flat arrays standing for memory from the base address on: each row's block of x
    given to `quantize` (block -> (values, scale)), written to q and s."""
    for xo, qo, so, sx, sq, nr, nc in rows.tolist():
        r = np.arange(nr)[:, None]
        c = np.arange(nc)[None, :]
        values, scale = quantize(x[xo + r * sx + c])
        q[qo + r * sq + c] = values
        s[so] = scale


def fake_quantize(block: np.ndarray) -> tuple[np.ndarray, float]:
    """Any function of the whole block, shape included: a wrong or partial block changes its output."""
    return block * 2.0 + 1.0, float(block.sum() * 3.0 + block.shape[0] * 1000 + block.shape[1])


@st.composite
def jobs(draw):
    """(block, [(job fields, x view spec)]) with jobs packed one after another in x, q and s memory."""
    block = (draw(st.integers(1, 6)), draw(st.integers(1, 6)))
    out, at = [], {"x": draw(st.integers(0, 5)), "q": draw(st.integers(0, 5)), "s": 0}
    for _ in range(draw(st.integers(0, 5))):
        n, k = draw(st.integers(0, 14)), draw(st.integers(0, 14))
        sx, sq = k + draw(st.integers(0, 4)), k + draw(st.integers(0, 4))
        nb, kb = -(-n // block[0]), -(-k // block[1])
        column_major = draw(st.booleans())
        ss0, ss1 = (1, max(nb, 1)) if column_major else (max(kb, 1), 1)
        out.append((at["x"], at["q"], at["s"], n, k, sx, sq, ss0, ss1))
        at["x"] += n * sx + draw(st.integers(0, 3))
        at["q"] += n * sq + draw(st.integers(0, 3))
        at["s"] += nb * kb + draw(st.integers(0, 2))
    return block, out, at


@settings(max_examples=150, deadline=None)
@given(jobs())
def test_the_table_quantizes_every_block_of_every_job_and_nothing_else(drawn):
    block, js, size = drawn
    rng = np.random.default_rng(len(js))
    x = rng.standard_normal(size["x"] + 8)
    q = np.full(size["q"] + 8, np.nan)
    s = np.full(size["s"] + 8, np.nan)
    apply_table(table(js, block), x, q, s, fake_quantize)

    want_q, want_s = np.full_like(q, np.nan), np.full_like(s, np.nan)
    bn, bk = block
    for xo, qo, so, n, k, sx, sq, ss0, ss1 in js:  # an independent walk: 2-D views, blocks by slicing
        xv = as_strided(x[xo:], (n, k), (sx * 8, 8))
        qv = as_strided(want_q[qo:], (n, k), (sq * 8, 8), writeable=True)
        for bi in range(-(-n // bn)):
            for bj in range(-(-k // bk)):
                rows, cols = slice(bi * bn, (bi + 1) * bn), slice(bj * bk, (bj + 1) * bk)
                values, scale = fake_quantize(xv[rows, cols])
                qv[rows, cols] = values
                want_s[so + bi * ss0 + bj * ss1] = scale
    np.testing.assert_array_equal(q, want_q)
    np.testing.assert_array_equal(s, want_s)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 64), st.integers(0, 64), st.integers(0, 40), st.integers(0, 40), st.integers(0, 3),
       st.integers(0, 3), st.sampled_from([(4, 8), (16, 16), (8, 32)]), st.sampled_from([1, 2, 4, 8]))
def test_an_aligned_job_has_every_block_on_whole_vectors(xo, qo, n, k, pad_x, pad_q, block, x_align):
    job = (xo, qo, 0, n, k, k + pad_x, k + pad_q, 1, 1)
    rows = block_rows(job, block)
    if aligned(job, block, x_align, 16):
        assert np.all(rows[:, 0] % x_align == 0) and np.all(rows[:, 3] % x_align == 0)
        assert np.all(rows[:, 1] % 16 == 0) and np.all(rows[:, 4] % 16 == 0)
        assert np.all(rows[:, 6] % x_align == 0) and np.all(rows[:, 6] % 16 == 0)


def test_a_job_of_no_elements_has_no_blocks_and_bad_blocks_are_refused():
    assert block_rows((0, 0, 0, 0, 7, 7, 7, 1, 1), (4, 4)).shape == (0, 7)
    assert table([], (4, 4)).shape == (0, 7)
    with pytest.raises(ValueError, match="block"):
        block_rows((0, 0, 0, 4, 4, 4, 4, 1, 1), (0, 4))
    with pytest.raises(ValueError, match="shape"):
        block_rows((0, 0, 0, -1, 4, 4, 4, 1, 1), (4, 4))
