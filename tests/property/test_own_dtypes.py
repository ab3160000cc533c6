"""Tensors kept in a wider dtype than the model's (DeepSeek-V3's float32 router bias in a bfloat16 model) travel
bit-exact, over random Megatron and vLLM layouts: plans count them in units of the model's dtype, executors
view them so, and the result equals the destination layout's own sharding of the canonical weights."""
from __future__ import annotations

import torch
from hypothesis import assume, given, strategies as st

import reshard
from reshard.errors import LayoutError
from reshard.executors import allocate, execute_local, shard
from harness.refit_cases import tiny_deepseek

SENTINEL = -7.0


SPEC = tiny_deepseek()


@st.composite
def deepseek_refits(draw):
    try:
        src = reshard.MegatronLayout(model=SPEC, tp=draw(st.sampled_from([1, 2])), pp=draw(st.sampled_from([1, 2])),
                                     ep=draw(st.sampled_from([1, 2, 4])))
        dst = reshard.VllmLayout(model=SPEC, tp=draw(st.sampled_from([1, 2, 4])),
                                 replicas=draw(st.sampled_from([1, 2])), expert_parallel=draw(st.booleans()))
    except LayoutError:
        assume(False)
    return src, dst


def _weights(seed: int) -> dict[str, torch.Tensor]:
    """Random values with low mantissa bits set, so that a bfloat16 rounding of the float32 ones would show."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for t in SPEC.tensors:
        w = torch.randn(t.shape, generator=g, dtype=torch.float64) * (1 + 1e-3 * torch.rand(t.shape, generator=g))
        out[t.name] = w.to(torch.float32 if t.dtype == "float32" else torch.bfloat16)
    return out


@given(deepseek_refits(), st.integers(0, 2**16), st.sampled_from([None, 1]))
def test_wider_tensors_arrive_bit_exact(pair, seed, fanout):
    src, dst = pair
    plan = reshard.compile(src, dst, fanout=fanout if dst.num_replicas > 1 else None)
    assert set(plan.own_dtypes) == {t.name for t in SPEC.own_dtype_tensors}
    weights = _weights(seed)
    got = allocate(dst, fill=SENTINEL)
    execute_local(plan, shard(src, weights), got)
    want = shard(dst, weights, fill=SENTINEL)
    for rank, tensors in want.items():
        for name, expected in tensors.items():
            assert got[rank][name].dtype == expected.dtype, f"{dst} rank {rank} {name}"
            assert torch.equal(got[rank][name].view(torch.uint8), expected.view(torch.uint8)), \
                f"{dst} rank {rank} {name}"
    # the bytes the plan counts are the model's bytes, the float32 tensors at four bytes an element
    nbytes = sum(t.numel * (4 if t.dtype == "float32" else 2) for t in SPEC.tensors)
    assert plan.accounting.model_bytes == nbytes
