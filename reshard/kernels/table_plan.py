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


def _by_word(entries: np.ndarray, base: int, words: tuple[int, ...], fields: int, who: str) -> dict[int, np.ndarray]:
    """{word: the entries (src address, dst address, nbytes[, stream position]) of nbytes > 0 whose widest dividing
    word size is `word`}; ValueError for a base not aligned to the widest word or a negative length or position."""
    if base % words[0]:
        raise ValueError(f"{who}: base {base:#x} is not {words[0]}-byte aligned")
    e = np.asarray(entries, dtype=np.int64).reshape(-1, fields)
    if np.any(e[:, 2:] < 0):
        raise ValueError(f"{who}: negative length or position")
    e = e[e[:, 2] > 0]
    w = word_bytes(e, words, fields)
    return {word: e[w == word] for word in words if np.any(w == word)}


def _pieces(k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Entries cut into k[i] pieces each: every piece's entry and its index within the entry."""
    owner = np.repeat(np.arange(len(k)), k)
    return owner, np.arange(len(owner)) - np.repeat(np.cumsum(k) - k, k)


def chunk_words(chunk_bytes: int, word: int) -> int:
    """Words per chunk: chunk_bytes rounded down to whole words (at least one)."""
    return max(1, int(chunk_bytes) // int(word))


def chunk_table(entries: np.ndarray, base: int, chunk_bytes: int) -> dict[int, np.ndarray]:
    """{word: int64 [chunks, 3]} for entries (src address, dst address, nbytes): each entry of nbytes > 0 cut into
    chunks of at most chunk_words(chunk_bytes, word) words, offsets in words from `base` (16-byte aligned; may be
    above an address: offsets are signed). Every byte of every entry is in exactly one chunk."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_table: chunk_bytes must be >= 1, not {chunk_bytes}")
    out = {}
    for w, mine in _by_word(entries, base, WORDS, 3, "chunk_table").items():
        per = chunk_words(chunk_bytes, w)
        n = mine[:, 2] // w
        owner, j = _pieces(-(-n // per))  # chunks per entry, each chunk's index within its entry
        start = j * per
        out[w] = np.stack([(mine[owner, 0] - base) // w + start, (mine[owner, 1] - base) // w + start,
                           np.minimum(per, n[owner] - start)], axis=1).astype(np.int64)
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
    if window_bytes < SUM_WORDS[0] or window_bytes % SUM_WORDS[0] or period % window_bytes:
        raise ValueError(f"window_table: window_bytes {window_bytes} must be a multiple of {SUM_WORDS[0]} dividing "
                         f"the period {period}")
    windows = period // window_bytes
    out = {}
    for w, mine in _by_word(entries, base, SUM_WORDS, 4, "window_table").items():
        first = mine[:, 3] // window_bytes
        owner, j = _pieces((mine[:, 3] + mine[:, 2] - 1) // window_bytes - first + 1)  # a piece per window crossed
        cut = first[owner] + j  # window index
        pos, end = mine[owner, 3], mine[owner, 3] + mine[owner, 2]
        start = np.maximum(pos, cut * window_bytes)
        stop = np.minimum(end, (cut + 1) * window_bytes)
        rows = np.stack([(mine[owner, 0] + (start - pos) - base) // w, (mine[owner, 1] + (start - pos) - base) // w,
                         (stop - start) // w, (start % window_bytes) // w, start // period], axis=1).astype(np.int64)
        g = (start % period) // window_bytes
        order = np.lexsort((rows[:, 3], rows[:, 4], g))
        rows, g = rows[order], g[order]
        starts = np.searchsorted(g, np.arange(int(g.max()) + 2)).astype(np.int64)
        assert starts[-1] == len(rows) and len(starts) - 1 <= windows
        out[w] = (rows, starts)
    return out

