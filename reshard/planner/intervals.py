"""Interval search over the distinct source boxes of one canonical tensor.

Boxes are sorted by their dim-0 start with a running maximum of dim-0 ends, so a query walks back from the
last box starting before the query's end and stops as soon as no earlier box can reach the query: O(log n + k)
for the disjoint boxes layouts produce, never all pairs.
"""
from __future__ import annotations

import bisect
from typing import Sequence


class BoxIndex:
    def __init__(self, offsets: Sequence[tuple[int, ...]], lengths: Sequence[tuple[int, ...]]):
        order = sorted(range(len(offsets)), key=lambda i: offsets[i])
        self._ids = order
        self._off = [offsets[i] for i in order]
        self._len = [lengths[i] for i in order]
        self._starts = [o[0] for o in self._off]
        self._max_end: list[int] = []
        running = -1
        for o, n in zip(self._off, self._len):
            running = max(running, o[0] + n[0])
            self._max_end.append(running)

    def query(self, offset: tuple[int, ...], lengths: tuple[int, ...]) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
        """(box id, intersection offset, intersection lengths) of every box meeting the query box."""
        hits = []
        i = bisect.bisect_left(self._starts, offset[0] + lengths[0]) - 1
        while i >= 0 and self._max_end[i] > offset[0]:
            lo = tuple(max(a, b) for a, b in zip(offset, self._off[i]))
            hi = tuple(min(a + m, b + n) for a, m, b, n in zip(offset, lengths, self._off[i], self._len[i]))
            if all(h > l for l, h in zip(lo, hi)):
                hits.append((self._ids[i], lo, tuple(h - l for l, h in zip(lo, hi))))
            i -= 1
        hits.reverse()
        return hits
