"""What every executor checks before the first byte moves, whatever the plan's origin: `check_ops` (every op's
ranks, tensors and block lie inside its tensors, by the plan's tables; the verdict kept on the plan) and
`check_memory` (dense tensors with storage, no destination overlapping another tensor). Both raise
ExecutionError naming the op or the tensors.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from ..errors import ExecutionError, show
from ..limits import MAX_PARAMS

_CHECKED = "_reshard_ops_checked"


def refuse(field: str, value: Any, rule: str) -> ExecutionError:
    """An ExecutionError for an input the executor refuses (field, value and rule set as on input errors)."""
    text = field if value is None else f"{field}={show(value)}"
    e = ExecutionError(f"{text} {rule}; nothing was moved")
    e.field, e.value, e.rule = field, value, rule
    return e


def check_ops(plan: Any) -> None:
    """Raise ExecutionError unless every op of `plan` names existing ranks and tensors, has positive sizes and
    strides no narrower than its rows, and stays inside its tensors."""
    if plan.__dict__.get(_CHECKED):
        return
    o = plan.ops  # a Plan checked its program's indices when it was built (planner.program)
    n = len(o["rows"])
    S, D = plan.src.num_ranks, plan.dst.num_ranks
    st, dt = plan.src_tensors, plan.dst_tensors

    def bad(mask: np.ndarray, column: str, rule: str) -> None:
        idx = np.flatnonzero(mask)
        if len(idx):
            i = int(idx[0])
            raise refuse(f"plan op {i} {column}", int(o[column][i]), f"{rule} ({len(idx)} of {n} ops; plan "
                         f"{plan.digest[:12]})")

    relay = o["src_side"] == 1
    bad((o["src_side"] != 0) & ~relay, "src_side", "must be 0 (a source rank) or 1 (a relaying destination rank)")
    bad((o["src_rank"] < 0) | (o["src_rank"] >= np.where(relay, D, S)), "src_rank", "is not a rank of its side")
    bad((o["dst_rank"] < 0) | (o["dst_rank"] >= D), "dst_rank", f"is not a destination rank [0, {D})")
    bad((o["src_tensor"] < 0) | (o["src_tensor"] >= np.where(relay, len(dt), len(st))), "src_tensor",
        "is not a tensor of the plan's table")
    bad((o["dst_tensor"] < 0) | (o["dst_tensor"] >= len(dt)), "dst_tensor", "is not a tensor of the plan's table")
    # a relay reads a destination tensor: index both tables as one, the destination's after the source's
    src_at = np.where(relay, len(st) + o["src_tensor"], o["src_tensor"])
    bad(np.concatenate([st.rank, dt.rank])[src_at] != o["src_rank"], "src_tensor", "is a tensor of another rank")
    bad(dt.rank[o["dst_tensor"]] != o["dst_rank"], "dst_tensor", "is a tensor of another rank")
    for column in ("rows", "cols", "src_stride", "dst_stride"):
        bad((o[column] < 1) | (o[column] > MAX_PARAMS), column, "must be a positive count within the limits")
    for side in ("src", "dst"):
        bad((o["rows"] > 1) & (o[f"{side}_stride"] < o["cols"]), f"{side}_stride",
            "is narrower than the block's columns (its rows would overlap)")
        bad((o[f"{side}_offset"] < 0) | (o[f"{side}_offset"] > MAX_PARAMS), f"{side}_offset",
            "must be an offset within the limits")
    # all factors are now below 2**47: the products fit int64
    d_numel = dt.numel()
    for side, size in (("src", np.concatenate([st.numel(), d_numel])[src_at]), ("dst", d_numel[o["dst_tensor"]])):
        end = o[f"{side}_offset"] + (o["rows"] - 1) * o[f"{side}_stride"] + o["cols"]
        bad(end > size, f"{side}_offset", "puts the block past the end of its tensor")
    bad(o["stage"] < 0, "stage", "must be >= 0")
    plan.__dict__[_CHECKED] = True


def check_memory(src: Mapping[int, Mapping[str, Any]], dst: Mapping[int, Mapping[str, Any]]) -> None:
    """Raise ExecutionError unless the tensors are dense, hold memory (no meta or sparse tensor), and no destination
    overlaps another destination or a source."""
    spans = []
    for side, given in (("source", src), ("destination", dst)):
        for rank, tensors in given.items():
            for name, t in tensors.items():
                what = f"{side} rank {rank} {name!r}"
                if not isinstance(t, torch.Tensor):
                    raise refuse(what, None, f"is a {type(t).__name__}, not a torch.Tensor")
                if t.layout != torch.strided:
                    raise refuse(what, None, f"has layout {t.layout}; only dense (strided) tensors are copied")
                if t.device.type == "meta":
                    raise refuse(what, None, "is a meta tensor, which holds no memory to copy into or from")
                nbytes = t.numel() * t.element_size()
                if nbytes:
                    start = t.data_ptr()
                    spans.append((str(t.device), start, start + nbytes, side == "destination", what))
    spans.sort(key=lambda s: (s[0], s[1]))
    reach: tuple | None = None  # the span reaching furthest so far on this device
    for span in spans:
        if reach is not None and reach[0] == span[0] and span[1] < reach[2] and (reach[3] or span[3]):
            raise refuse(span[4], None, f"shares memory with {reach[4]}: a destination tensor may overlap no "
                         f"other tensor of the refit")
        if reach is None or reach[0] != span[0] or span[2] > reach[2] or (span[3] and span[2] == reach[2]):
            reach = span


def refuse_disagreement(problem: str | None, bad: int, same: bool, differs: str) -> None:
    """After a group's preflight vote: raise if this process found a problem, another refused its tensors, or the
    processes do not run the same refit (`same` false; `differs` says what must agree). Nothing was moved yet.

    Raises:
        ExecutionError: naming which of the three it was.
    """
    if problem:
        raise ExecutionError(f"{problem}; nothing was moved")
    if bad:
        raise ExecutionError("another process of the refit group refused its tensors (its own error says why); "
                             "nothing was moved")
    if not same:
        raise ExecutionError(f"the processes of the refit group do not run the same {differs}; nothing was moved")


__all__ = ["check_memory", "check_ops", "refuse", "refuse_disagreement"]
