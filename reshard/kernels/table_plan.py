"""The tables of kernels.copy_table and kernels.copy_sum64 in plain numpy, property-tested on any machine."""
from __future__ import annotations

import numpy as np

WORDS = (16, 8, 4, 2, 1)  # word sizes in bytes, widest first


def word_bytes(entries: np.ndarray, words: tuple[int, ...] = WORDS, fields: int = 3) -> np.ndarray:
    """Per entry (src address, dst address, nbytes[, stream position]): the widest of `words` dividing every field."""
    e = np.asarray(entries, dtype=np.int64).reshape(-1, fields)
    out = np.ones(len(e), dtype=np.int64)
    for w in words[::-1]:
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


# --- the copy-and-checksum kernel's table (kernels.copy_sum64) ---

SUM_WORDS = (16, 4, 1)  # its word classes: 16-byte vectors of int32 words, int32 words, single bytes


def window_table(entries: np.ndarray, base: int, window_bytes: int, period: int) -> dict[int, tuple]:
    """{word: (rows int64 [k, 5], starts int64 [windows + 1])} for entries (src address, dst address, nbytes,
    stream position): the stream's positions folded by `period` (the checksum weights' period) into columns, the
    columns cut into windows of `window_bytes`; each entry cut where it crosses a window boundary, each piece a row
    (source offset, destination offset, length, column offset in its window, period number), in words (offsets
    from `base`, 16-byte aligned), rows sorted by window then period; window g's rows are starts[g]:starts[g+1].
    A kernel program per window adds up the bytes of each column over all periods (each byte read once), and only
    then weighs the columns (kernels.copy_sum64)."""
    if base % SUM_WORDS[0]:
        raise ValueError(f"window_table: base {base:#x} is not {SUM_WORDS[0]}-byte aligned")
    if window_bytes < SUM_WORDS[0] or window_bytes % SUM_WORDS[0] or period % window_bytes:
        raise ValueError(f"window_table: window_bytes {window_bytes} must be a multiple of {SUM_WORDS[0]} dividing "
                         f"the period {period}")
    e = np.asarray(entries, dtype=np.int64).reshape(-1, 4)
    if np.any(e[:, 2] < 0) or np.any(e[:, 3] < 0):
        raise ValueError("window_table: negative length or position")
    e = e[e[:, 2] > 0]
    words = word_bytes(e, SUM_WORDS, 4)
    windows = period // window_bytes
    out = {}
    for w in SUM_WORDS:
        mine = e[words == w]
        if not len(mine):
            continue
        first = mine[:, 3] // window_bytes
        last = (mine[:, 3] + mine[:, 2] - 1) // window_bytes
        k = last - first + 1  # pieces per entry
        owner = np.repeat(np.arange(len(mine)), k)
        cut = np.repeat(first, k) + np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k)  # window index
        pos, end = mine[owner, 3], mine[owner, 3] + mine[owner, 2]
        start = np.maximum(pos, cut * window_bytes)
        stop = np.minimum(end, (cut + 1) * window_bytes)
        rows = np.empty((len(owner), 5), dtype=np.int64)
        rows[:, 0] = (mine[owner, 0] + (start - pos) - base) // w
        rows[:, 1] = (mine[owner, 1] + (start - pos) - base) // w
        rows[:, 2] = (stop - start) // w
        rows[:, 3] = (start % window_bytes) // w
        rows[:, 4] = start // period
        g = (start % period) // window_bytes
        order = np.lexsort((rows[:, 3], rows[:, 4], g))
        rows, g = rows[order], g[order]
        starts = np.searchsorted(g, np.arange(int(g.max()) + 2)).astype(np.int64)
        assert starts[-1] == len(rows) and len(starts) - 1 <= windows
        out[w] = (rows, starts)
    return out

