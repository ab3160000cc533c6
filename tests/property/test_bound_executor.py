"""The bound local executor (views made once, one batched copy per refit) lands every plan exactly as the reference
ReferenceExecutor does, refit after refit with new source values in the same tensors; it refuses what it cannot run."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import reshard
from reshard.errors import ExecutionError
from reshard.executors import allocate, execute_local, make_executor, shard
from reshard.testing.strategies import refits

SENTINEL = -7.0


@settings(max_examples=60)
@given(refits(), st.integers(0, 2**16))
def test_bound_equals_reference_over_refits(pair, seed):
    src, dst = pair
    plan = reshard.compile(src, dst)
    g = torch.Generator().manual_seed(seed)
    weights = {t.name: torch.randn(t.shape, generator=g) for t in src.model.tensors}
    source = shard(src, weights)
    got, want = allocate(dst, fill=SENTINEL), allocate(dst, fill=SENTINEL)
    ex = make_executor("inprocess", plan, None, 0, source, got)
    for step in range(2):
        if step:  # the trainer's step, in place
            for tensors in source.values():
                for t in tensors.values():
                    t.mul_(0.5).add_(1.0)
        ex.refit()
        execute_local(plan, source, want)
        for rank, tensors in want.items():
            for name, t in tensors.items():
                assert torch.equal(got[rank][name], t), (str(dst), rank, name)


def test_bound_refuses_replaced_tensors_and_relays():
    spec = reshard.ModelSpec(family="qwen3", hidden_size=16, num_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=4, intermediate_size=24, vocab_size=100, qk_norm=True,
                             dtype="float32")
    src, dst = reshard.MegatronLayout(model=spec, tp=2), reshard.VllmLayout(model=spec, tp=2)
    plan = reshard.compile(src, dst)
    source, target = allocate(src), allocate(dst)
    ex = make_executor("inprocess", plan, None, 0, source, target)
    name = next(iter(target[0]))
    target[0][name] = torch.zeros_like(target[0][name])  # a new tensor where the bound one was
    ex.refit()  # the dict entry changed, the bound tensor did not: still fine
    with torch.no_grad():
        ex._pins.tensors[0].set_(torch.zeros_like(ex._pins.tensors[0]))  # the bound tensor's storage replaced
    with pytest.raises(ExecutionError, match="replaced"):
        ex.refit()
    relayed = reshard.compile(src, reshard.VllmLayout(model=spec, tp=2, replicas=2), fanout=1)
    with pytest.raises(ExecutionError, match="relays"):
        make_executor("inprocess", relayed, None, 0, allocate(src), allocate(relayed.dst))
    with pytest.raises(ExecutionError, match="lacks source ranks"):
        make_executor("inprocess", plan, None, 0, {0: allocate(src)[0]}, allocate(dst))
