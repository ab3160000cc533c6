"""The inprocess transport refits through a bound executor kept while the trainer publishes the same tensors in
place, binds afresh when it publishes other tensors, and lands what the reference LocalExecutor lands each time
(the GPU test of the same runs with the CUDA graph)."""
from __future__ import annotations

import torch

import reshard
from reshard.adapters.refit import RefitSpec, open_transport, publish_source, withdraw_source
from reshard.executors import allocate, execute_local, shard


def test_inprocess_refits_bound_and_rebound_equal_reference():
    spec = reshard.ModelSpec(family="qwen3", hidden_size=32, num_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, intermediate_size=48, vocab_size=100, qk_norm=True,
                             dtype="bfloat16")
    src_l, dst_l = reshard.MegatronLayout(model=spec, tp=2), reshard.VllmLayout(model=spec)
    refit = RefitSpec.of(spec, src_l, dst_l, transport="inprocess", options={"key": "bound-test"})
    g = torch.Generator().manual_seed(0)
    src = shard(src_l, {t.name: torch.randn(t.shape, generator=g).to(torch.bfloat16) for t in spec.tensors})
    dst = allocate(dst_l, -7.0)
    publish_source("bound-test", src)
    try:
        ex = open_transport(refit, 0, {}, dst)
        bound = []
        for step in range(4):
            if step == 2:  # the trainer publishes other tensors: bound afresh
                src = {r: {n: t.clone().add_(3.0) for n, t in ts.items()} for r, ts in src.items()}
                publish_source("bound-test", src)
            elif step:  # the trainer's step, in place
                for ts in src.values():
                    for t in ts.values():
                        t.mul_(0.5)
            ex.refit()
            bound.append(ex._bound)
            want = allocate(dst_l, -7.0)
            execute_local(refit.plan(), src, want)
            assert all(torch.equal(dst[0][n], want[0][n]) for n in want[0]), step
        assert bound[0] is bound[1] and bound[2] is not bound[1] and bound[3] is bound[2]
    finally:
        withdraw_source("bound-test")
