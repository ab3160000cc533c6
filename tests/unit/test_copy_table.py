"""The table-copy kernel's chunk table (kernels.table_plan), property-tested in numpy without Triton: for random
copies (lengths, addresses of every alignment, chunk sizes), applying the table's chunks moves exactly the bytes
the copies move, each chunk in the widest word that all its copy's addresses and length allow. The kernel itself
is tested byte for byte in test_kernels.py (interpreter) and on the GPU (test_kernels_gpu.py)."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.kernels.table_plan import WORDS, chunk_table, word_bytes

SIZE = 4096


def apply_table(memory: np.ndarray, tables: dict[int, np.ndarray]) -> None:
    """What kernels.copy_table does, in numpy over a byte array standing for memory from the base address on: every
    chunk's bytes copied from its source to its destination."""
    for w, rows in tables.items():
        for s, d, n in rows.tolist():
            memory[d * w:(d + n) * w] = memory[s * w:(s + n) * w]


def apply_window_table(memory: np.ndarray, tables: dict[int, tuple], window_bytes: int, period: int,
                       weights) -> tuple[int, int, int]:
    """What kernels.copy_sum64 does, in numpy over a byte array standing for memory from the base address on: every
    row's bytes copied, and the sums (s1, s2, s3 of executors.checksum, mod 2^64) computed as the kernel does: per
    window, each column's bytes added over the periods, then weighed by its stream position and T[column]; the
    position's period part from each row's byte sum times its period. `weights(j)`: T for columns j."""
    s1 = s2 = s3 = 0
    for w, (rows, starts) in tables.items():
        for g in range(len(starts) - 1):
            col = np.zeros(window_bytes, dtype=np.int64)
            by_period = 0
            for s, d, n, c0, p in rows[starts[g]:starts[g + 1]].tolist():
                x = memory[s * w:(s + n) * w].copy()
                memory[d * w:(d + n) * w] = x
                col[c0 * w:(c0 + n) * w] += x
                by_period += p * int(x.astype(np.int64).sum())
            j = g * window_bytes + np.arange(window_bytes, dtype=np.int64)
            s1 += int(col.sum())
            s2 += int(((j + 1) * col).sum()) + period * by_period
            s3 += int((weights(j) * col).sum())
    mask = (1 << 64) - 1
    return s1 & mask, s2 & mask, s3 & mask


@st.composite
def copies(draw):
    """Non-overlapping destinations in the upper half of a 2*SIZE memory, sources anywhere in the lower half."""
    out, free = [], 0
    for _ in range(draw(st.integers(0, 8))):
        n = draw(st.integers(0, 300))
        gap = draw(st.integers(0, 40))
        if free + gap + n > SIZE:
            break
        src = draw(st.integers(0, SIZE - n))
        out.append((src, SIZE + free + gap, n))
        free += gap + n
    return out


@settings(max_examples=100, deadline=None)
@given(copies(), st.integers(1, 700), st.sampled_from([0, 16, 1 << 40]))
def test_chunk_table_moves_exactly_the_copies_bytes(entries, chunk_bytes, base):
    """Memory index i stands for address base + i (base 16-byte aligned, so an index's alignment is its
    address's)."""
    rng = np.random.default_rng(len(entries) + chunk_bytes)
    mem = rng.integers(0, 256, 2 * SIZE, dtype=np.uint8)
    want = mem.copy()
    for s, d, n in entries:
        want[d:d + n] = mem[s:s + n]
    addresses = np.asarray([(base + s, base + d, n) for s, d, n in entries], dtype=np.int64).reshape(-1, 3)
    tables = chunk_table(addresses, base, chunk_bytes)
    got = mem.copy()
    apply_table(got, tables)
    assert np.array_equal(got, want)
    for w, rows in tables.items():
        assert w in WORDS and np.all(rows[:, 2] >= 1) and np.all(rows[:, 2] * w <= max(chunk_bytes, w))
    assert sum(int(rows[:, 2].sum()) * w for w, rows in tables.items()) == sum(n for _, _, n in entries)
    for (s, d, n), w in zip(entries, word_bytes(addresses).tolist()):  # the widest word that fits
        assert s % w == 0 and d % w == 0 and n % w == 0
        assert w == 16 or s % (2 * w) or d % (2 * w) or n % (2 * w)


def test_chunk_table_refuses_an_unaligned_base_and_bad_sizes():
    import pytest

    with pytest.raises(ValueError, match="aligned"):
        chunk_table(np.zeros((1, 3), dtype=np.int64), 8, 64)
    with pytest.raises(ValueError, match="chunk_bytes"):
        chunk_table(np.zeros((1, 3), dtype=np.int64), 0, 0)
    with pytest.raises(ValueError, match="negative"):
        chunk_table(np.asarray([[0, 16, -1]]), 0, 64)


@settings(max_examples=60, deadline=None)
@given(copies(), st.sampled_from([16, 32, 64]), st.sampled_from([64, 128, 1 << 23]),
       st.sampled_from([0, 1000, (1 << 23) - 48, 1 << 40]), st.sampled_from([0, 16, 1 << 40]))
def test_window_table_copies_the_bytes_and_folds_the_sums_like_the_reference(entries, window, period, start, base):
    """The copy-and-checksum table (kernels.table_plan.window_table, kernels.copy_sum64): every byte of every copy
    in exactly one row, and the sums computed the kernel's way (columns added over periods, weighed once) equal
    count, sum x, sum x (i + 1), sum x T[i mod period] over the stream's bytes at positions start..., mod 2^64."""
    from reshard.kernels.table_plan import SUM_WORDS, window_table, word_bytes

    if window > period:
        return
    rng = np.random.default_rng(len(entries) + window)
    mem = rng.integers(0, 256, 2 * SIZE, dtype=np.uint8)
    want, stream, pos, rows4 = mem.copy(), [], start, []
    for s, d, n in entries:
        want[d:d + n] = mem[s:s + n]
        stream.append(mem[s:s + n])
        rows4.append((base + s, base + d, n, pos))
        pos += n
    tables = window_table(np.asarray(rows4, dtype=np.int64).reshape(-1, 4), base, window, period)

    def weights(j):
        return ((j * 1_103_515_245 + 12_345) & ((1 << 31) - 1)) >> 8

    got = mem.copy()
    sums = apply_window_table(got, tables, window, period, weights)
    assert np.array_equal(got, want)
    x = np.concatenate(stream).astype(np.int64) if stream else np.zeros(0, dtype=np.int64)
    i = np.arange(start, start + len(x), dtype=np.int64)
    ref = (int(x.sum()), sum(int(v) * (int(k) + 1) for v, k in zip(x, i)), int((x * weights(i % period)).sum()))
    assert sums == tuple(v & ((1 << 64) - 1) for v in ref)
    for w, (rows, starts) in tables.items():
        assert w in SUM_WORDS and np.all(rows[:, 2] >= 1) and np.all((rows[:, 3] + rows[:, 2]) * w <= window)
        assert starts[0] == 0 and starts[-1] == len(rows) and np.all(np.diff(starts) >= 0)
    for e, w in zip(rows4, word_bytes(rows4, SUM_WORDS, 4).tolist()):
        assert all(v % w == 0 for v in e) and (w == 16 or any(v % (4 if w == 1 else 16) for v in e))
