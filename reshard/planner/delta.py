"""Delta plans: the part of a plan's ops a refit runs when only some source elements changed, and the proof that
it writes every changed element exactly once and nothing else.

Each op that changed travels in the smallest of three encodings (`choose`, ties to DENSE): DENSE, its whole box;
SPARSE, the changed elements' box-local indices (int32, r * cols + c, ascending) and values; BITMAP, one bit per
element of the box (bit j of byte k is element 8k + j) and the changed values. In bf16 SPARSE wins below 1/32 of
an op's elements changed, BITMAP up to 15/16, DENSE above.

`prove_delta` extends the plan's coverage proof (its ops write disjoint boxes tiling the model data): a delta
writes every destination element at most once, and only model data, when 1. every op appears at most once and
2. each non-dense op's indices are strictly increasing and inside its box; and it carries no more than the dense
refit when 3. every non-dense encoding is smaller than its dense block.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import CoverageError

DENSE, SPARSE, BITMAP = 0, 1, 2
ENCODINGS = ("dense", "sparse", "bitmap")
PROOF_CHUNK = 1 << 26  # indices whose order one step of the proof checks (a temporary of 512 MiB)
INDEX_BYTES = 4  # a SPARSE index: int32, so a box holds at most 2^31 - 1 elements (a plan op is far smaller)


def encoded_bytes(box: np.ndarray, count: np.ndarray, itemsize: int) -> np.ndarray:
    """Bytes of each encoding (columns DENSE, SPARSE, BITMAP) of ops of `box` elements of which `count` changed."""
    box, count = np.asarray(box, dtype=np.int64), np.asarray(count, dtype=np.int64)
    return np.stack([box * itemsize, count * (INDEX_BYTES + itemsize), (box + 7) // 8 + count * itemsize], axis=-1)


def choose(box: np.ndarray, count: np.ndarray, itemsize: int) -> np.ndarray:
    """The smallest encoding of each op (DENSE on ties): int8 codes."""
    return np.argmin(encoded_bytes(box, count, itemsize), axis=-1).astype(np.int8)


@dataclass(frozen=True, eq=False)
class DeltaOps:
    """A delta refit's ops (see the module docstring).

    Attributes:
        op: plan op rows (into `Plan.ops`), one per entry.
        encoding: DENSE, SPARSE or BITMAP per entry.
        count: elements each entry writes (its box for DENSE, the changed ones otherwise).
        index: the box-local indices of the non-dense entries, concatenated in entry order: an int64 tensor on
            the device of the payload they came from or go into (a GPU's indices are proven where they are; given
            as an array, on the CPU).
    """

    op: np.ndarray
    encoding: np.ndarray
    count: np.ndarray
    index: torch.Tensor

    def __post_init__(self) -> None:
        for name in ("op", "encoding", "count"):
            object.__setattr__(self, name, np.ascontiguousarray(getattr(self, name), dtype=np.int64).reshape(-1))
        index = self.index
        if not isinstance(index, torch.Tensor):
            index = torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64))
        object.__setattr__(self, "index", index.reshape(-1).long())

    def __len__(self) -> int:
        return len(self.op)


def _box(plan, op: np.ndarray) -> np.ndarray:
    o = plan.ops
    return o["rows"][op] * o["cols"][op]


def prove_delta(plan, delta: DeltaOps, allowed: "np.ndarray | None" = None, indices: bool = True) -> None:
    """Raise CoverageError listing every problem unless `delta` satisfies 1-3 of the module docstring (`plan`'s own
    coverage proof holds). `allowed`: the plan op rows it may contain (a receiver's ops from one sender; None: any);
    `indices` False: the entries only, not their indices (a receiver sizes a payload's sections by them)."""
    problems: list[str] = []
    op, enc, count, index = delta.op, delta.encoding, delta.count, delta.index
    bad = np.flatnonzero((op < 0) | (op >= plan.num_ops))
    problems += [f"entry {i}: op {op[i]} is not an op of the plan ({plan.num_ops} ops)" for i in bad[:5]]
    if allowed is not None:
        stray = np.flatnonzero(~np.isin(op, allowed))
        problems += [f"entry {i}: op {op[i]} is not one of the ops this receiver gets from this sender"
                     for i in stray[:5]]
    ordered = np.sort(op)
    problems += [f"op {v} appears twice" for v in ordered[1:][ordered[1:] == ordered[:-1]][:5]]
    problems += [f"entry {i}: encoding {enc[i]} is not one of {ENCODINGS}" for i in
                 np.flatnonzero((enc < 0) | (enc > 2))[:5]]
    if problems:
        raise CoverageError("delta proof failed", problems)
    box = _box(plan, op)
    dense = enc == DENSE
    problems += [f"op {op[i]}: dense entry of {count[i]} elements, its box has {box[i]}"
                 for i in np.flatnonzero(dense & (count != box))[:5]]
    problems += [f"op {op[i]}: {count[i]} changed elements in a box of {box[i]}"
                 for i in np.flatnonzero(~dense & ((count < 1) | (count > box)))[:5]]
    sizes = encoded_bytes(box, count, plan.itemsize)
    big = np.flatnonzero(~dense & (sizes[np.arange(len(op)), enc.clip(0, 2)] >= sizes[:, DENSE]))
    problems += [f"op {op[i]}: its {ENCODINGS[enc[i]]} encoding ({sizes[i, enc[i]]} B) is not smaller than the dense "
                 f"block it replaces ({sizes[i, DENSE]} B)" for i in big[:5]]
    if not problems and indices and int(count[~dense].sum()) != len(index):
        problems.append(f"{len(index)} indices for {int(count[~dense].sum())} changed elements")
    if problems:
        raise CoverageError("delta proof failed", problems)
    if not indices:
        return
    # 2, where the indices are (a GPU's stay there): within each entry strictly increasing, and its first and last
    # inside its box, so every one is; O(changed)
    k = np.flatnonzero(~dense)
    count_k, box_k = count[k], box[k]
    ends = np.cumsum(count_k)
    starts = ends - count_k
    at = lambda positions: torch.from_numpy(positions).to(index.device)  # noqa: E731
    first, last = (index[at(x)].cpu().numpy() for x in (starts, ends - 1))
    first_out = (first < 0) | (first >= box_k)
    out = np.where(first_out, first, last)  # one problem an entry: its first index, else its last
    for j in np.flatnonzero(first_out | (last < 0) | (last >= box_k))[:5].tolist():
        problems.append(f"op {op[k[j]]}: index {out[j]} outside its box of {box_k[j]} elements")
    between = starts[1:] - 1  # from one entry's last index to the next one's first: no order between them
    falls = np.zeros(0, np.int64)
    for a in range(0, len(index) - 1, PROOF_CHUNK):  # a bounded temporary however many indices came
        b = min(a + PROOF_CHUNK, len(index) - 1)
        rise = index[a + 1:b + 1] - index[a:b]
        rise[at(between[(between >= a) & (between < b)] - a)] = 1
        falls = np.concatenate([falls, torch.nonzero(rise <= 0)[:5].view(-1).cpu().numpy() + a])[:5]
    owner = np.searchsorted(ends, falls, side="right")
    problems += [f"op {op[k[e]]}: indices not strictly increasing ({int(index[j])} then {int(index[j + 1])})"
                 for e, j in zip(owner.tolist(), falls.tolist())]
    if problems:
        raise CoverageError("delta proof failed", problems)


__all__ = ["BITMAP", "DENSE", "DeltaOps", "ENCODINGS", "INDEX_BYTES", "SPARSE", "choose", "encoded_bytes",
           "prove_delta"]
