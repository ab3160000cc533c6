"""FP8 block quantization on the GPU (run on the GPU machine: `-m gpu`): the library's eager quantizer gives on CUDA
the bytes the independently written CPU reference gives (amax per block, /448, e4m3fn, round to nearest even), for
full and edge blocks, zeros and values at the fp8 range; and a whole quantizing refit with CUDA tensors (senders
and receivers quantizing, eager and with the Triton kernel) equals the reference checkpoint."""
from __future__ import annotations

import pytest
import torch

import reshard
from reshard.executors.fp8 import Fp8Executor, quantize_blocks
from reshard.executors.reference import allocate, shard
from reshard.layouts.fp8 import FP8, Fp8Scheme
from reshard.planner.fp8 import compile_fp8
from harness.fp8_reference import reference_checkpoint, reference_quantize, same_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def _inputs():
    g = torch.Generator().manual_seed(7)
    for shape, scale in [((256, 384), 1.0), ((300, 200), 3.0), ((128, 128), 1e-3), ((1000, 130), 40.0)]:
        x = (torch.randn(shape, generator=g) * scale).to(torch.bfloat16)
        x[:64, :64] = 0  # a block part zero
        yield x
    x = torch.zeros(256, 256, dtype=torch.bfloat16)
    x[128:, 128:] = torch.tensor([448.0, -448.0, 1e-30, 0.5]).repeat(128, 32).to(torch.bfloat16)
    yield x


def test_gpu_quantizer_equals_cpu_reference():
    for x in _inputs():
        for block in [(128, 128), (64, 32)]:
            q, s = quantize_blocks(x.cuda(), block)
            rq, rs = reference_quantize(x, block)
            assert same_bytes(q, rq) and same_bytes(s, rs), (tuple(x.shape), block)
            out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device="cuda")
            q2, _ = quantize_blocks(x.cuda(), block, out)
            assert same_bytes(out, rq) and same_bytes(q2, rq)


@pytest.mark.parametrize("quantizer", ["eager", "kernel"])
def test_quantizing_refit_on_gpu_equals_reference(quantizer):
    cfg = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=256, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=128, vocab_size=500, intermediate_size=384,
               torch_dtype="bfloat16")
    spec = reshard.ModelSpec.from_hf_config(cfg)
    src_layout = reshard.MegatronLayout(model=spec, tp=2)
    fp = compile_fp8(src_layout, reshard.VllmLayout(model=spec), Fp8Scheme())
    assert set(fp.where.values()) == {"sender", "receiver"}  # the trainer's TP cuts the MLP through blocks
    g = torch.Generator().manual_seed(3)
    w = {t.name: (torch.randn(t.shape, generator=g) * 0.05).to(torch.bfloat16) for t in spec.tensors}
    src = {r: {n: t.cuda() for n, t in ts.items()} for r, ts in shard(src_layout, w).items()}
    dst = {r: {n: t.cuda() for n, t in ts.items()} for r, ts in allocate(fp.full_dst, -7.0).items()}
    if quantizer == "kernel":
        pytest.importorskip("triton")
    Fp8Executor(fp, None, 0, src, dst, quantizer=quantizer).refit()
    quantized = {t.name for t in fp.full_dst.model.tensors if t.dtype == FP8}
    want = shard(fp.full_dst, reference_checkpoint(w, quantized, fp.scheme.block), fill=-7.0)
    bad = [n for n, t in want[0].items() if not same_bytes(dst[0][n], t)]
    assert not bad, bad[:5]
