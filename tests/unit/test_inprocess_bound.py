"""The inprocess transport refits through an inprocess executor kept while the trainer publishes the same tensors in
place, binds afresh when it publishes other tensors, and lands what the ReferenceExecutor lands each time
(the GPU test of the same runs with the CUDA graph)."""
from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import torch

import reshard
from reshard.adapters.refit import RefitSpec, open_transport
from reshard.adapters.transports import publish_source, published_source, withdraw_source
from reshard.executors import allocate, execute_local, shard


def _stream(plan, src) -> np.ndarray:
    """The refit's source stream: every op's block in plan order, as bytes."""
    o, out = plan.ops, []
    for i in range(plan.num_ops):
        t = src[int(plan.src_tensors.ranks[o["src_tensor"][i]])][plan.src_tensors.names[o["src_tensor"][i]]]
        flat = t.reshape(-1).view(torch.uint8).numpy()
        k = plan.itemsize
        for r in range(int(o["rows"][i])):
            at = (int(o["src_offset"][i]) + r * int(o["src_stride"][i])) * k
            out.append(flat[at:at + int(o["cols"][i]) * k])
    return np.concatenate(out)


def _digest(algorithm: str, x: np.ndarray) -> str:
    """The digest of executors.checksum, written out: SHA-256, or count and three sums mod 2^64."""
    if algorithm == "sha256":
        return hashlib.sha256(x.tobytes()).hexdigest()
    b, i = x.astype(np.uint64), np.arange(len(x), dtype=np.uint64)
    j = (i % np.uint64(1 << 23)).astype(np.int64)
    t = (((j * 1_103_515_245 + 12_345) & ((1 << 31) - 1)) >> 8).astype(np.uint64)
    with np.errstate(over="ignore"):
        sums = [int(b.sum()), int((b * (i + np.uint64(1))).sum()), int((b * t).sum())]
    return struct.pack("<4Q", len(x), *(v & ((1 << 64) - 1) for v in sums)).hex()


@pytest.mark.parametrize("checksum", [False, "sum64", "sha256"])
def test_inprocess_refits_bound_and_rebound_equal_reference(checksum):
    spec = reshard.ModelSpec(family="qwen3", hidden_size=32, num_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, intermediate_size=48, vocab_size=100, qk_norm=True,
                             dtype="bfloat16")
    src_l, dst_l = reshard.MegatronLayout(model=spec, tp=2), reshard.VllmLayout(model=spec)
    refit = RefitSpec.of(spec, src_l, dst_l, transport="inprocess",
                         options={"key": "bound-test", "checksum": checksum})
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
            got = ex.refit()
            bound.append(ex._bound)
            if checksum:  # the digest of the bytes read, in plan order (on CPU: torch ops after the copies)
                assert got.digest == _digest(checksum, _stream(refit.plan(), src)), step
            else:
                assert got.digest == "" and got.checksum == ""
            want = allocate(dst_l, -7.0)
            execute_local(refit.plan(), src, want)
            assert all(torch.equal(dst[0][n], want[0][n]) for n in want[0]), step
        assert bound[0] is bound[1] and bound[2] is not bound[1] and bound[3] is bound[2]
    finally:
        withdraw_source("bound-test")


def test_inprocess_refuses_an_unknown_checksum():
    from reshard.errors import ArgumentError

    spec = reshard.ModelSpec(family="qwen3", hidden_size=32, num_layers=1, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, intermediate_size=48, vocab_size=100, dtype="bfloat16")
    refit = RefitSpec.of(spec, reshard.MegatronLayout(model=spec), reshard.VllmLayout(model=spec),
                         transport="inprocess", options={"key": "x", "checksum": "crc"})
    with pytest.raises(ArgumentError, match="checksum"):
        open_transport(refit, 0, {}, {})


def test_pins_count_replaced_storages():
    from reshard.errors import ExecutionError
    from reshard.executors.graphs import Pins

    ts = [torch.zeros(4) for _ in range(5)]
    pins = Pins(ts)
    pins.check()
    ts[1].data = torch.zeros(4)  # a new storage behind the same tensor object
    ts[3].set_(torch.zeros(8).untyped_storage())
    with pytest.raises(ExecutionError, match="2 bound tensors were replaced"):
        pins.check()


def test_a_publication_is_a_read_only_snapshot_of_the_mapping():
    from reshard.errors import ArgumentError

    a, b = torch.zeros(3), torch.ones(3)
    mine = {0: {"a": a}}
    publish_source("snap-test", mine)
    try:
        first = published_source("snap-test")
        mine[0]["a"] = b  # the caller's mapping changes; the publication does not
        assert published_source("snap-test") is first and first[0]["a"] is a
        with pytest.raises(TypeError):
            first[0]["a"] = b  # read-only
        publish_source("snap-test", mine)
        assert published_source("snap-test") is not first and published_source("snap-test")[0]["a"] is b
        for bad in ([a], {0: [a]}, None):
            with pytest.raises(ArgumentError, match="tensors"):
                publish_source("snap-test", bad)
    finally:
        withdraw_source("snap-test")
