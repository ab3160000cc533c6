"""The round trip of one model: for seeded random (source, destination) layout pairs, the compiled plan executed
on random weights must give every destination rank exactly `shard(destination, weights)`, padding untouched."""
from __future__ import annotations

import random

import torch

from ..errors import LayoutError
from ..executors import allocate, execute_local, shard
from ..layouts import HfLayout, ModelSpec
from ..planner import compile_plan
from ..testing.random_layouts import megatron_layout, vllm_layout

SENTINEL = -7.0


def round_trip(spec: ModelSpec, examples: int = 20) -> str:
    """Check `examples` random layout pairs of `spec` (float32), seeds 0, 1, ... (a refused pair is skipped, up to
    10 x `examples` seeds).

    Returns:
        A one-line summary with one of the pairs.

    Raises:
        AssertionError: a destination byte differs, or no seed gave a pair this family accepts.
    """
    spec = spec.model_copy(update={"dtype": "float32"})
    seen: list[str] = []
    for seed in range(10 * examples):
        if len(seen) == examples:
            break
        pick = random.Random(seed).choice
        try:  # a family's own tensors may refuse a topology the generic rules allow
            src = megatron_layout(spec, pick)
            dst = vllm_layout(spec, pick) if pick([True, True, False]) else HfLayout(model=spec)
        except LayoutError:
            continue
        plan = compile_plan(src, dst)
        g = torch.Generator().manual_seed(seed)
        weights = {t.name: torch.randn(t.shape, generator=g) for t in spec.tensors}
        got = allocate(dst, fill=SENTINEL)
        execute_local(plan, shard(src, weights), got)
        # a value shift (Plan.value_shifts) may change the last bit: shifted tensors compared to 2 ulps, others exactly
        shifted = {(p.rank, p.tensor) for t in spec.tensors if t.index in plan.value_shifts for p in dst.placements(t)}
        for rank, tensors in shard(dst, weights, fill=SENTINEL).items():
            for name, expected in tensors.items():
                same = (torch.allclose(got[rank][name], expected, rtol=2**-22, atol=2**-22)
                        if (rank, name) in shifted else torch.equal(got[rank][name], expected))
                assert same, f"{src} -> {dst} (seed {seed}): rank {rank} {name} differs"
        seen.append(f"{src} -> {dst}")
    assert seen, f"no random layout pair of {spec} was accepted in {10 * examples} seeds"
    return f"{len(seen)} random layout pairs, every destination byte equal (e.g. {seen[-1]})"
