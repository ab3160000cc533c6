"""Quantizing refits over random models, layouts and block sizes: the quantize-where choice is sound (a kind is
quantized by senders only where every source rank holding part of it holds whole blocks) and complete up to its
stated rules, the destination refuses exactly the cuts that split blocks, the wire bytes are the bf16 bytes
minus one byte per fp8 element plus four per scale, and the engine's tensors equal an independently quantized
checkpoint laid out by the destination layout, byte for byte."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, event, given, settings, strategies as st

import reshard
from reshard.errors import ExecutionError, LayoutError
from reshard.executors.fp8 import Fp8Executor
from reshard.executors.reference import allocate, shard
from reshard.layouts.fp8 import Fp8Scheme, quantized_entries
from reshard.planner.fp8 import compile_fp8
from harness.fp8_jobs import execute_fp8_local
from harness.fp8_reference import reference_checkpoint, same_bytes
from reshard.testing.strategies import megatron_layouts, models, vllm_layouts

SENTINEL = -7.0


def _split_blocks(layout: reshard.Layout, t: reshard.TensorSpec, block: tuple[int, int]) -> bool:
    """Whether some rank holds part of a block of `t` but not all of it (element sets, from the placements)."""
    return _blocks(layout, t, block)[0]


def _piece_split(layout: reshard.Layout, t: reshard.TensorSpec, block: tuple[int, int]) -> bool:
    """Whether a block lies in two pieces (two places of one rank's physical tensors: no one scale cell)."""
    return _blocks(layout, t, block)[1]


def _blocks(layout, t, block) -> tuple[bool, bool]:
    bn, bk = block
    grids: dict[int, np.ndarray] = {}
    for k, p in enumerate(layout.placements(t)):
        if not all(p.lengths):
            continue
        grid = grids.setdefault(p.rank, np.full(t.shape, -1, dtype=np.int64))
        grid[p.canon_offset[0]:p.canon_offset[0] + p.lengths[0], p.canon_offset[1]:p.canon_offset[1] + p.lengths[1]] = k
    rank_split = piece_split = False
    for grid in grids.values():
        for i in range(0, t.shape[0], bn):
            for j in range(0, t.shape[1], bk):
                b = grid[i:i + bn, j:j + bk]
                held = b[b >= 0]
                rank_split |= 0 < held.size < b.size
                piece_split |= len(np.unique(held)) > 1
    return rank_split, piece_split


def _misaligned(layout: reshard.Layout, t: reshard.TensorSpec, block: tuple[int, int]) -> bool:
    """Whether a piece sits at a physical offset that is not a block boundary (its scale has no block cell)."""
    return any(o % b for p in layout.placements(t) if all(p.lengths) for o, b in zip(p.phys_offset[-2:], block))


@st.composite
def cases(draw):
    model = draw(models(dtype="bfloat16"))
    block = (draw(st.sampled_from([2, 4, 8])), draw(st.sampled_from([2, 4, 8])))
    whole = st.builds(reshard.VllmLayout, model=st.just(model), replicas=st.integers(1, 2))  # TP 1 splits nothing
    hf = st.builds(reshard.HfLayout, model=st.just(model), replicas=st.integers(1, 2))  # the loader's canonical tensors
    dst = draw(st.one_of(vllm_layouts(model), whole, hf))
    return draw(megatron_layouts(model)), dst, block, draw(st.integers(0, 2 ** 16))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_quantizing_refits(case):
    src, dst, block, seed = case
    spec, scheme = src.model, Fp8Scheme(block=block)
    kinds = quantized_entries(spec, scheme)
    first = {name: next(t for t in spec.tensors if _template(spec, t) == name) for name in kinds}
    dst_splits = [n for n, t in first.items() if _split_blocks(dst, t, block) or _piece_split(dst, t, block)
                  or _misaligned(dst, t, block)]
    try:
        fp = compile_fp8(src, dst, scheme)
    except LayoutError as e:  # the destination refuses, naming a tensor, dim and block: only where it must
        assert dst_splits, f"refused although no destination cut splits a block: {e}"
        assert e.values.get("block") is not None and e.values.get("dim") in (0, 1)
        event("destination refused")
        return
    assert not dst_splits, f"accepted a destination whose cuts split blocks of {dst_splits}"
    where = set(fp.where.values())
    event(f"kinds on senders: {'all' if where == {'sender'} else 'some' if 'sender' in where else 'none'}")

    # where: sound, and complete up to the stated rules
    for name, where in fp.where.items():
        t = first[name]
        if where == "sender":
            assert not _split_blocks(src, t, block), f"{name}: quantized by senders that do not hold whole blocks"
        else:
            why = fp.why[name]
            assert (_split_blocks(src, t, block) or _piece_split(src, t, block) or _misaligned(src, t, block)
                    or "shares source tensor" in why or "pairs" in why), f"{name}: on the receivers without a reason"

    # wire bytes: the bf16 bytes, minus one per fp8 element and plus four per scale the destinations receive
    d = fp.full_dst
    delta = 0
    for t in d.model.tensors:
        template = _template(d.model, t).removesuffix("_scale_inv")
        if fp.where.get(template) != "sender":
            continue
        n = sum(int(np.prod(p.lengths)) for p in d.placements(t))
        delta += -n if t.dtype == "float8_e4m3fn" else 4 * n
    assert fp.wire_bytes == fp.baseline_bytes + delta

    # bytes: the engine's tensors equal the reference checkpoint laid out by the destination
    g = torch.Generator().manual_seed(seed)
    weights = {t.name: torch.randn(t.shape, generator=g).to(torch.bfloat16) for t in spec.tensors}
    got = allocate(d, SENTINEL)
    execute_fp8_local(fp, shard(src, weights), got)
    quantized = {t.name for t in d.model.tensors if t.dtype == "float8_e4m3fn"}
    want = shard(d, reference_checkpoint(weights, quantized, block), fill=SENTINEL)
    bad = [f"rank {r} {n}" for r in want for n in want[r] if not same_bytes(got[r][n], want[r][n])]
    assert not bad, f"{src} -> {dst} block {block}: {bad[:5]}"

    # both in-process paths: quantized straight into the engine's tensors (where the plan allows) and through
    # the wire's shadows and the inprocess executor's copies; each equals the reference checkpoint
    for direct in (True, False):
        try:
            out = allocate(d, SENTINEL)
            ex = Fp8Executor(fp, None, 0, shard(src, weights), out, inner="inprocess", direct=direct)
        except ExecutionError as e:
            assert direct and "straight into" in str(e)
            event("direct quantization refused")
            continue
        event(f"direct={direct}")
        ex.refit()
        bad = [f"rank {r} {n}" for r in want for n in want[r] if not same_bytes(out[r][n], want[r][n])]
        assert not bad, f"direct={direct} {src} -> {dst} block {block}: {bad[:5]}"


def _template(spec: reshard.ModelSpec, t: reshard.TensorSpec) -> str:
    c = spec.canonical
    return c.entries[int(c.entry[t.index])].name
