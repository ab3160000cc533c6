"""Check a live vLLM model against the declared destination layout before any byte moves, every problem at once:
its weights' names, shapes and dtypes, and where its own loaders put each probed canonical element (derive.py),
which catches a stacking order or KV replication that differs while the shapes agree.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

import torch

from ...errors import LayoutMismatchError
from ...layouts import Layout, Placement, VllmLayout
from .derive import DerivedLayout, declared_placements, derive_layout, probed_tensors
from .live import dtype_name, weights


def widens(plan_dtype: str, live_dtype: str) -> bool:
    """True if the engine keeps a tensor in a wider floating type than the plan moves it in (vLLM keeps some
    small tensors in float32, e.g. Qwen3.5's A_log or DeepSeek's router bias): every value the plan carries
    is exact there, so a direct install lands it in plan dtype and casts it up (DirectBinding.finish)."""
    plan, live = getattr(torch, plan_dtype, None), getattr(torch, live_dtype, None)
    return (isinstance(plan, torch.dtype) and isinstance(live, torch.dtype) and live.is_floating_point
            and plan.is_floating_point and plan != live and torch.promote_types(plan, live) == live)


def structure_problems(live: dict[str, tuple[tuple[int, ...], str]], layout: Layout, rank: int) -> list[str]:
    """What differs between the live rank's weights ({name: (shape, dtype)}) and what `layout` declares for `rank`."""
    declared = layout.rank_tensors(rank)
    problems = []
    for name in sorted(set(live) | set(declared)):
        want_dtype = layout.tensor_dtype(rank, name)  # DeepSeek's float32 router bias: its own
        if name not in live:
            problems.append(f"{name}: declared {tuple(declared[name])} {want_dtype}, but the live model has no "
                            f"such parameter")
        elif name not in declared:
            problems.append(f"{name}: the live model has {live[name][0]} {live[name][1]}, which the declared "
                            f"layout does not hold")
        elif tuple(live[name][0]) != tuple(declared[name]) or not (
                live[name][1] == want_dtype or widens(want_dtype, live[name][1])):
            problems.append(f"{name}: live {live[name][0]} {live[name][1]}, declared {tuple(declared[name])} "
                            f"{want_dtype}")
    return problems


def _fmt(p: Placement) -> str:
    box = ", ".join(f"{o}:{o + n}" for o, n in zip(p.canon_offset, p.lengths))
    return f"[{box}] at {p.tensor}{list(p.phys_offset)}"


def merged_boxes(boxes: set[Placement]) -> set[Placement]:
    """The same elements as fewest boxes: boxes that continue each other along one dimension, in the canonical
    tensor and in the physical one alike, become one (a fused stack declared as q, k and v parts that a loader
    writes as one run is the same placement)."""
    boxes = set(boxes)
    merged = True
    while merged:
        merged = False
        for d in range(max((len(p.lengths) for p in boxes), default=0)):
            def key(p: Placement):
                rest = lambda t: t[:d] + t[d + 1:]  # noqa: E731
                return (p.rank, p.tensor, p.shape, rest(p.canon_offset), rest(p.lengths), rest(p.phys_offset))
            groups: dict[tuple, list[Placement]] = defaultdict(list)
            for p in boxes:
                if len(p.lengths) > d:
                    groups[key(p)].append(p)
            for group in groups.values():
                group.sort(key=lambda p: p.canon_offset[d])
                for a, b in zip(group, group[1:]):
                    if (a.canon_offset[d] + a.lengths[d] == b.canon_offset[d]
                            and a.phys_offset[d] + a.lengths[d] == b.phys_offset[d]):
                        grow = lambda t, n: t[:d] + (n,) + t[d + 1:]  # noqa: E731
                        boxes -= {a, b}
                        boxes.add(a._replace(lengths=grow(a.lengths, a.lengths[d] + b.lengths[d])))
                        merged = True
                        break
                if merged:
                    break
            if merged:
                break
    return boxes


def placement_problems(derived: Sequence[tuple[str, Placement]], declared: Sequence[tuple[str, Placement]]) \
        -> list[str]:
    """What differs between where the loaders put each probed tensor (`derived`) and where the layout says
    (`declared`)."""
    got: dict[str, set[Placement]] = defaultdict(set)
    want: dict[str, set[Placement]] = defaultdict(set)
    for canon, p in derived:
        got[canon].add(p)
    for canon, p in declared:
        want[canon].add(p)
    got = defaultdict(set, {c: merged_boxes(ps) for c, ps in got.items()})
    want = defaultdict(set, {c: merged_boxes(ps) for c, ps in want.items()})
    problems = []
    for canon in sorted(set(got) | set(want)):
        if got[canon] != want[canon]:
            order = lambda ps: sorted(ps, key=lambda p: (p.tensor, p.phys_offset))  # noqa: E731
            problems.append(f"{canon}: declared {', '.join(map(_fmt, order(want[canon]))) or 'nowhere'}; "
                            f"vLLM's loaders put {', '.join(map(_fmt, order(got[canon]))) or 'nothing'}")
    return problems


def check_layout(model: torch.nn.Module, layout: Layout, rank: int, layers: Sequence[int] | None = None,
                 vllm_config: Any = None, loaders: bool = True,
                 params: dict[str, torch.nn.Parameter] | None = None) -> DerivedLayout:
    """Raise LayoutMismatchError unless rank `rank` of `layout` is what this live model holds and what its
    loaders write (for the canonical tensors of `layers`, default all). Returns the derived layout.
    `params`: the model's `live.weights`, where the caller has read them already."""
    where = f"rank {rank} of the live vLLM model ({type(model).__name__})"
    params = weights(model) if params is None else params
    live = {n: (tuple(p.shape), dtype_name(p.dtype)) for n, p in params.items()}
    problems = structure_problems(live, layout, rank)
    if problems:
        raise LayoutMismatchError(str(layout), problems, where=where)
    if not loaders:
        return DerivedLayout(rank, live)
    derived = derive_layout(model, layout.model, rank, layers, vllm_config, params)
    # vLLM's loaders write experts by its initial placement, whatever EPLB did since: the probe is compared with
    # that; the live placement is checked against the EPLB state (experts.check_placement)
    probe = layout.with_initial_experts() if isinstance(layout, VllmLayout) else layout
    declared = declared_placements(probe, rank, probed_tensors(layout.model, layers))
    problems = list(derived.problems) + placement_problems(derived.placements, declared)
    if problems:
        raise LayoutMismatchError(str(layout), problems, where=where)
    return derived
