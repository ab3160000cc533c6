"""The chunk table of kernels.copy_table in plain numpy (no Triton, no torch): which word each copy moves in, and
its cut into chunks as rows of (source offset, destination offset, length) in words from one base address. Kept
apart so that it is property-tested on any machine (tests/unit/test_copy_table.py) and the kernel only reads it."""
from __future__ import annotations

import numpy as np

WORDS = (16, 8, 4, 2, 1)  # word sizes in bytes, widest first


def word_bytes(entries: np.ndarray) -> np.ndarray:
    """Per entry (src address, dst address, nbytes): the widest word in WORDS dividing all three."""
    e = np.asarray(entries, dtype=np.int64).reshape(-1, 3)
    out = np.ones(len(e), dtype=np.int64)
    for w in WORDS[::-1]:
        out[np.all(e % w == 0, axis=1)] = w
    return out


def chunk_words(chunk_bytes: int, word: int) -> int:
    """Words per chunk: chunk_bytes rounded down to whole words (at least one)."""
    return max(1, int(chunk_bytes) // int(word))


def chunk_table(entries: np.ndarray, base: int, chunk_bytes: int) -> dict[int, np.ndarray]:
    """{word: int64 [chunks, 3]} for entries (src address, dst address, nbytes): each entry of nbytes > 0 cut into
    chunks of at most chunk_words(chunk_bytes, word) words, offsets in words from `base` (16-byte aligned; may be
    above an address: offsets are signed). Every byte of every entry is in exactly one chunk."""
    if base % WORDS[0]:
        raise ValueError(f"chunk_table: base {base:#x} is not {WORDS[0]}-byte aligned")
    if chunk_bytes < 1:
        raise ValueError(f"chunk_table: chunk_bytes must be >= 1, not {chunk_bytes}")
    e = np.asarray(entries, dtype=np.int64).reshape(-1, 3)
    if np.any(e[:, 2] < 0):
        raise ValueError("chunk_table: negative length")
    e = e[e[:, 2] > 0]
    words = word_bytes(e)
    out = {}
    for w in WORDS:
        mine = e[words == w]
        if not len(mine):
            continue
        per = chunk_words(chunk_bytes, w)
        n = mine[:, 2] // w
        k = -(-n // per)  # chunks per entry
        owner = np.repeat(np.arange(len(mine)), k)
        first = np.cumsum(k) - k
        j = np.arange(int(k.sum())) - np.repeat(first, k)  # chunk index within its entry
        start = j * per
        rows = np.empty((len(owner), 3), dtype=np.int64)
        rows[:, 0] = (mine[owner, 0] - base) // w + start
        rows[:, 1] = (mine[owner, 1] - base) // w + start
        rows[:, 2] = np.minimum(per, n[owner] - start)
        out[w] = rows
    return out


def apply_table(memory: np.ndarray, tables: dict[int, np.ndarray]) -> None:
    """What the kernel does, in numpy over a byte array standing for memory from the base address on (for the
    table's property test): every chunk's bytes copied from its source to its destination."""
    for w, rows in tables.items():
        for s, d, n in rows.tolist():
            memory[d * w:(d + n) * w] = memory[s * w:(s + n) * w]
