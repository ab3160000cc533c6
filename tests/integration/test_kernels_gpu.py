"""The GPU paths of issue 31 on the GPU machine (`-m gpu`), byte for byte against the references: the Triton FP8
quantizer (hardware cast and the integer cast the interpreter uses; all jobs in one launch, every warps setting
swept by benchmarks/refit_inprocess.py), whole
quantizing refits with it, the sum64 kernel and the shared executor's digests, the inprocess executor (CUDA graph) and
the inprocess transport against the ReferenceExecutor, refit after refit."""
from __future__ import annotations

import pytest
import torch

import reshard
from reshard.executors import allocate, execute_local, make_executor, shard
from reshard.executors import copies
from reshard.executors.inprocess import InProcessExecutor
from reshard.kernels import KernelTuning
from harness import kernel_checks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@pytest.mark.parametrize("exact_cast", [False, True], ids=["hardware-cast", "integer-cast"])
def test_fp8_quantizer_kernel_equals_reference_on_gpu(exact_cast):
    tunings = tuple(KernelTuning(quantize_warps=w) for w in (4, 8, 16))
    assert kernel_checks.check_fp8_table("cuda", cases=40, exact_cast=exact_cast, tunings=tunings) == []


def test_quantizing_refits_with_the_kernel_on_gpu():
    assert kernel_checks.check_fp8_refits("cuda") == []


def test_sum64_kernel_on_gpu():
    assert kernel_checks.check_sum64("cuda", cases=12) == []


def test_copy_sum64_kernel_on_gpu():
    """Also one 40 MB stream (five periods of the weights) and a bound refit with checksum="sum64" per TP pair."""
    assert kernel_checks.check_copy_sum64("cuda", cases=12, big=True) == []


def test_copy_table_kernel_on_gpu():
    assert kernel_checks.check_copy_table("cuda", cases=20) == []


def _qwen3(layers=2):
    return reshard.ModelSpec(family="qwen3", hidden_size=256, num_layers=layers, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=64, intermediate_size=512, vocab_size=1000,
                             qk_norm=True, dtype="bfloat16")


@pytest.mark.parametrize("table", [False, True], ids=["copies", "table"])
@pytest.mark.parametrize("tp", [(1, 1), (2, 1), (1, 2), (2, 4)])
def test_bound_executor_graph_equals_reference_on_gpu(tp, table, monkeypatch):
    spec = _qwen3()
    src_l, dst_l = reshard.MegatronLayout(model=spec, tp=tp[0]), reshard.VllmLayout(model=spec, tp=tp[1])
    plan = reshard.compile(src_l, dst_l)
    g = torch.Generator().manual_seed(sum(tp))
    w = {t.name: torch.randn(t.shape, generator=g).to(torch.bfloat16) for t in spec.tensors}
    src = {r: {n: t.cuda() for n, t in ts.items()} for r, ts in shard(src_l, w).items()}
    got = {r: {n: t.cuda() for n, t in ts.items()} for r, ts in allocate(dst_l, -7.0).items()}
    want = allocate(dst_l, -7.0)
    if table:  # a small model: its copies "large" enough for the table kernel
        monkeypatch.setattr(copies, "LARGE_BYTES", 4096)
        ex = InProcessExecutor(plan, None, 0, src, got, table=True)
        assert ex._table is not None and ex._table.count == len(ex._program.large) > 0
    else:
        ex = make_executor("inprocess", plan, None, 0, src, got)
    for step in range(3):  # eager, capture, replay
        if step:
            for ts in src.values():
                for t in ts.values():
                    t.mul_(0.5).add_(1.0)
        ex.refit()
        execute_local(plan, {r: {n: t.cpu() for n, t in ts.items()} for r, ts in src.items()}, want)
        torch.cuda.synchronize()
        bad = [(r, n) for r in want for n in want[r] if not torch.equal(got[r][n].cpu(), want[r][n])]
        assert not bad, (tp, step, bad[:4])
    assert ex._run.graph is not None, ex._run.error


def test_inprocess_transport_rebinds_when_the_trainer_publishes_new_tensors_on_gpu():
    from reshard.adapters.refit import RefitSpec, open_transport
    from reshard.adapters.transports import publish_source, withdraw_source

    spec = _qwen3(1)
    src_l, dst_l = reshard.MegatronLayout(model=spec), reshard.VllmLayout(model=spec)
    refit = RefitSpec.of(spec, src_l, dst_l, transport="inprocess", options={"key": "gpu-test"})
    w = {t.name: torch.randn(t.shape).to(torch.bfloat16) for t in spec.tensors}
    src = {r: {n: t.cuda() for n, t in ts.items()} for r, ts in shard(src_l, w).items()}
    dst = {r: {n: t.cuda() for n, t in ts.items()} for r, ts in allocate(dst_l, -7.0).items()}
    publish_source("gpu-test", src)
    try:
        ex = open_transport(refit, 0, {}, dst)
        for step in range(4):
            if step == 2:  # new tensors published: bound afresh
                src = {r: {n: t.clone().add_(3.0) for n, t in ts.items()} for r, ts in src.items()}
                publish_source("gpu-test", src)
            elif step:
                for t in src[0].values():
                    t.mul_(2.0)
            ex.refit()
            want = allocate(dst_l, -7.0)
            execute_local(refit.plan(), {0: {n: t.cpu() for n, t in src[0].items()}}, want)
            assert all(torch.equal(dst[0][n].cpu(), want[0][n]) for n in want[0]), step
    finally:
        withdraw_source("gpu-test")
