"""Copy programs: a plan's block copies folded into few strided 3-D copies, bound once as views of real tensors
and run with torch at every refit.

On a GPU each copy is a launch, so their number matters more than their size. Two folds cut it: adjacent blocks
merge (the planner's `merge_adjacent`), and blocks of one shape whose offsets advance by a constant step on both
sides become one 3-D copy (q / k / v groups, expert stacks, vocabulary rows). `view_copies` makes each copy a
(destination, source) view pair, read as 8-byte words where alignment allows: small pairs run as
`torch._foreach_copy_` groups (contiguous ones fused into few launches, strided ones looped in C++), large
contiguous pairs each as one `copy_` (a plain memcpy on CUDA, faster than the foreach kernel there).

Memory is named by (kind, id) in every executor: SRC / DST are the caller's tensors (ids of the plan's tables),
SHADOW a copy of a destination tensor this process keeps, WIRE a buffer bytes travel in, PEER + q process q's
memory for a destination tensor, mapped here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..errors import ExecutionError
from ..planner.merge import merge_adjacent

SRC, DST, SHADOW, WIRE, PEER = 0, 1, 2, 3, 4  # PEER + q: process q's memory (module docstring)
KIND_NAMES = ("source", "destination", "shadow", "wire buffer")
COPY_COLUMNS = ("src_kind", "src_id", "src_off", "src_step", "src_stride",
                "dst_kind", "dst_id", "dst_off", "dst_step", "dst_stride", "n", "rows", "cols")
WORD_BYTES = 8
LARGE_BYTES = 1 << 20  # contiguous copies at least this large run as single copy_ calls (a memcpy on GPUs)
WORD_DTYPES = {2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True, eq=False)
class Copies:
    """A program of strided 3-D block copies; copy k moves element [i, r, c] (i < n, r < rows, c < cols) from
    `src_off + i*src_step + r*src_stride + c` of memory (src_kind, src_id) to the same place on the dst side."""

    cols: dict[str, np.ndarray]

    def __post_init__(self) -> None:
        cols = {c: np.ascontiguousarray(self.cols[c], dtype=np.int64) for c in COPY_COLUMNS}
        for a in cols.values():
            a.setflags(write=False)
        object.__setattr__(self, "cols", cols)

    def __len__(self) -> int:
        return int(self.cols["n"].shape[0])

    @property
    def numel(self) -> int:
        """Elements moved by the whole program."""
        c = self.cols
        return int((c["n"] * c["rows"] * c["cols"]).sum())

    def select(self, mask: np.ndarray) -> "Copies":
        """The copies where boolean `mask` is set, in order."""
        return Copies({k: v[mask] for k, v in self.cols.items()})

    def rows_as_lists(self) -> list[tuple[int, ...]]:
        """Copies as plain tuples in COPY_COLUMNS order (fast to iterate in Python)."""
        return list(zip(*(self.cols[c].tolist() for c in COPY_COLUMNS)))

    @classmethod
    def empty(cls) -> "Copies":
        """A program of no copies."""
        return cls({c: np.zeros(0, np.int64) for c in COPY_COLUMNS})

    @classmethod
    def concat(cls, parts: list["Copies"]) -> "Copies":
        """The copies of `parts`, one program after the other."""
        if not parts:
            return cls.empty()
        return cls({c: np.concatenate([p.cols[c] for p in parts]) for c in COPY_COLUMNS})


def regions(program: Copies, frm: int, to: int) -> Copies:
    """Copies of the regions `program` writes, from memory kind `frm` to kind `to` at the same ids and places
    (an undo log: back a destination region up into its shadow before writing it, or restore it)."""
    c = program.cols
    side = {k: c[f"dst_{k}"] for k in ("id", "off", "step", "stride")}
    return Copies({**{f"src_{k}": v for k, v in side.items()}, **{f"dst_{k}": v for k, v in side.items()},
                   "src_kind": np.full(len(program), frm, np.int64), "dst_kind": np.full(len(program), to, np.int64),
                   "n": c["n"], "rows": c["rows"], "cols": c["cols"]})


def fold(src_kind, src_id, src_off, src_stride, dst_kind, dst_id, dst_off, dst_stride, rows, cols) -> Copies:
    """Fold 2-D block copies (equal-length int arrays, scalars broadcast) into a short program."""
    args = (src_kind, src_id, src_off, src_stride, dst_kind, dst_id, dst_off, dst_stride, rows, cols)
    lengths = {np.size(a) for a in args if np.ndim(a) > 0}
    if len(lengths) > 1:
        raise ExecutionError(f"fold needs equal-length columns, got lengths {sorted(lengths)}")
    n = lengths.pop() if lengths else 1
    full = lambda x: np.broadcast_to(np.asarray(x, dtype=np.int64), (n,)).copy()  # noqa: E731
    if n == 0:
        return Copies.empty()
    # 1. merge adjacent blocks, reusing the planner's merge on its column names
    zeros = np.zeros(n, np.int64)
    ops = merge_adjacent({
        "stage": zeros, "src_side": full(src_kind), "src_rank": zeros, "dst_rank": full(dst_kind),
        "src_tensor": full(src_id), "dst_tensor": full(dst_id), "src_offset": full(src_off),
        "src_stride": full(src_stride), "dst_offset": full(dst_off), "dst_stride": full(dst_stride),
        "rows": full(rows), "cols": full(cols), "canon": zeros,
    })
    # 2. arithmetic progressions of equal blocks: try ordering by source and by destination offset and keep,
    # per group of equal blocks, whichever gives fewer copies
    key_cols = ("src_side", "src_tensor", "dst_rank", "dst_tensor", "rows", "cols", "src_stride", "dst_stride")
    key = np.unique(np.stack([ops[c] for c in key_cols], axis=1), axis=0, return_inverse=True)[1].reshape(-1)
    by_src = _progressions(ops, key, "src_offset")
    by_dst = _progressions(ops, key, "dst_offset")
    n_groups = int(key.max()) + 1
    count_src = np.bincount(by_src["group"], minlength=n_groups)
    count_dst = np.bincount(by_dst["group"], minlength=n_groups)
    use_dst = count_dst < count_src
    out = {c: np.concatenate([by_src[c][~use_dst[by_src["group"]]], by_dst[c][use_dst[by_dst["group"]]]])
           for c in by_src}
    out.pop("group")
    return Copies(out)


def _progressions(ops: dict[str, np.ndarray], key: np.ndarray, order_by: str) -> dict[str, np.ndarray]:
    """Cut ops (sorted by key, then `order_by`) into runs whose offsets advance by one positive step on both
    sides; return one 3-D copy per run (plus its key group)."""
    order = np.lexsort((ops[order_by], key))
    k = key[order]
    s, d = ops["src_offset"][order], ops["dst_offset"][order]
    n = len(k)
    ds, dd = np.diff(s), np.diff(d)
    # delta j (from op j to op j+1) can chain only inside one key group and forwards on both sides
    ok = (k[1:] == k[:-1]) & (ds > 0) & (dd > 0)
    # greedy from the left, except that an op whose incoming step differs from the one before starts afresh
    # (it could sometimes have ended the previous run instead): a run's steps are then all equal
    starts = np.ones(n, dtype=bool)
    starts[1:] = ~ok
    if n > 2:
        starts[2:] |= ok[:-1] & ((ds[1:] != ds[:-1]) | (dd[1:] != dd[:-1]))
    first = np.flatnonzero(starts)
    count = np.diff(np.concatenate([first, [n]]))
    second = np.minimum(first + 1, n - 1)
    step_s = np.where(count > 1, s[second] - s[first], 1)
    step_d = np.where(count > 1, d[second] - d[first], 1)
    pick = order[first]
    return {
        "src_kind": ops["src_side"][pick], "src_id": ops["src_tensor"][pick], "src_off": s[first],
        "src_step": step_s, "src_stride": ops["src_stride"][pick],
        "dst_kind": ops["dst_rank"][pick], "dst_id": ops["dst_tensor"][pick], "dst_off": d[first],
        "dst_step": step_d, "dst_stride": ops["dst_stride"][pick],
        "n": count, "rows": ops["rows"][pick], "cols": ops["cols"][pick], "group": k[first],
    }


def copy_view(flat: torch.Tensor, off: int, step: int, stride: int, n: int, rows: int, cols: int) -> torch.Tensor:
    """One side of a copy as a view of its flat (1-D) memory: 1-D, 2-D or 3-D as the copy needs."""
    if n == 1 and rows == 1:
        return flat.narrow(0, off, cols)
    if n == 1:
        return flat.as_strided((rows, cols), (stride, 1), flat.storage_offset() + off)
    return flat.as_strided((n, rows, cols), (step, stride, 1), flat.storage_offset() + off)


def word_elements(copies: Copies, itemsize: int) -> np.ndarray:
    """Per copy, how many elements one 8-byte word may hold given its offsets, steps, strides and width."""
    most = max(WORD_BYTES // itemsize, 1)
    c = copies.cols
    g = np.full(len(copies), most, dtype=np.int64)
    for col, used in (("src_off", True), ("dst_off", True), ("cols", True),  # steps and strides where they apply
                      ("src_step", c["n"] > 1), ("dst_step", c["n"] > 1),
                      ("src_stride", c["rows"] > 1), ("dst_stride", c["rows"] > 1)):
        g = np.gcd(g, np.where(used, c[col], 0))
    return g & -g  # the largest power of two dividing it (elements per word are powers of two)


class Memory:
    """Flat views of named memory, and views of the same bytes as wider words where alignment allows."""

    def __init__(self, flat: Callable[[int, int], torch.Tensor], itemsize: int) -> None:
        self.flat, self.itemsize = flat, itemsize
        self._wide: dict[tuple[int, int, int], torch.Tensor | None] = {}

    def get(self, kind: int, i: int, per_word: int) -> torch.Tensor | None:
        """The memory as words of `per_word` elements, or None if its alignment does not allow them."""
        t = self.flat(kind, i)
        if per_word == 1:
            return t
        key = (kind, i, per_word)
        if key not in self._wide:
            dtype = WORD_DTYPES.get(per_word * self.itemsize)
            ok = (dtype is not None and t.storage_offset() % per_word == 0 and t.numel() % per_word == 0
                  and t.data_ptr() % (per_word * self.itemsize) == 0)
            self._wide[key] = t.view(dtype) if ok else None
        return self._wide[key]


class CopyViews:
    """A program's copies as view pairs; `run()` launches them on the current stream."""

    __slots__ = ("large", "groups", "count")

    def __init__(self, large: list[tuple], groups: list[tuple[list, list]], count: int) -> None:
        self.large, self.groups, self.count = large, groups, count

    def run(self) -> None:
        """Launch every copy on the current stream."""
        for dst, src in self.large:
            dst.copy_(src)
        for dst, src in self.groups:
            torch._foreach_copy_(dst, src)

    def __len__(self) -> int:
        return self.count


def view_copies(copies: Copies, memory: Memory, itemsize: int) -> CopyViews:
    """View pairs for a program: large contiguous pairs alone; small contiguous pairs grouped by word type
    (so that they fuse into few launches); strided pairs in one more group."""
    per_word = word_elements(copies, itemsize).tolist()
    large: list[tuple] = []
    dense: dict[torch.dtype, tuple[list, list]] = {}
    strided: tuple[list, list] = ([], [])
    for (sk, si, so, sst, ssr, dk, di, do, dst_, dsr, n, r, c), w in zip(copies.rows_as_lists(), per_word):
        s, d = memory.get(sk, si, w), memory.get(dk, di, w)
        while s is None or d is None:  # a side's alignment does not allow words this wide: halve them
            w //= 2
            s, d = memory.get(sk, si, w), memory.get(dk, di, w)
        sv = copy_view(s, so // w, sst // w, ssr // w, n, r, c // w)
        dv = copy_view(d, do // w, dst_ // w, dsr // w, n, r, c // w)
        contiguous = sv.is_contiguous() and dv.is_contiguous()
        if contiguous and sv.numel() * sv.element_size() >= LARGE_BYTES:
            large.append((dv, sv))
            continue
        group = dense.setdefault(sv.dtype, ([], [])) if contiguous else strided
        group[0].append(dv)
        group[1].append(sv)
    groups = [g for g in (*dense.values(), strided) if g[0]]
    return CopyViews(large, groups, len(copies))
