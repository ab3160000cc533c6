"""The flip of a staged refit on one GPU (issue 40, benchmark b): a Qwen3-30B-A3B engine shard of vLLM TP 2 (the
engine's own tensor shapes, random bf16 weights), its staged copy flipped into the live tensors as a worker does
(`reshard.adapters.vllm.staging.Staging.flip`: one `copy_` per tensor, waited for once; `torch._foreach_copy_`
of the same tensors beside it),
against the ceiling: one device copy of the same bytes in one flat tensor. Also the flip from pinned host memory
(staging="host") against one flat pinned host-to-device copy of the same bytes, unless --no-host.

Needs torch and reshard's core (the shapes are written out from the model's config below; no vLLM):

    python benchmarks/refit_flip.py --json out.json          # on one H100 / H200; goal: flip <= 50 ms
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from reshard.adapters.vllm.staging import Staging

# Qwen3-30B-A3B (examples/configs/qwen3-30b-a3b.json)
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2048, 48, 32, 4, 128
EXPERTS, MOE_INTER, VOCAB = 128, 768, 151936


def shard_shapes(tp: int = 2) -> dict[str, tuple[int, ...]]:
    """One TP rank's parameters of vLLM's Qwen3MoeForCausalLM (merged qkv, fused w13 experts, vocab-parallel)."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB // tp, HIDDEN),
                                          "lm_head.weight": (VOCAB // tp, HIDDEN), "model.norm.weight": (HIDDEN,)}
    qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM // tp
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.qkv_proj.weight": (qkv, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM // tp),
            p + "self_attn.q_norm.weight": (HEAD_DIM,), p + "self_attn.k_norm.weight": (HEAD_DIM,),
            p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "mlp.gate.weight": (EXPERTS, HIDDEN),
            p + "mlp.experts.w13_weight": (EXPERTS, 2 * MOE_INTER // tp, HIDDEN),
            p + "mlp.experts.w2_weight": (EXPERTS, HIDDEN, MOE_INTER // tp)})
    return shapes


def timed(fn, device: torch.device, repeats: int) -> list[float]:
    """Seconds per call (each waited for), after one warm-up."""
    fn()
    torch.cuda.synchronize(device)
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-host", action="store_true", help="skip the pinned-host staging")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    shapes = shard_shapes(args.tp)
    nbytes = sum(torch.Size(s).numel() * 2 for s in shapes.values())
    results: dict = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                     "tensors": len(shapes), "bytes": nbytes, "tp": args.tp}
    # the ceiling first, alone on the device (two flat copies of the shard's bytes)
    flat_a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    flat_b = torch.empty(nbytes, dtype=torch.uint8, device=device)
    results["copy_s"] = timed(lambda: flat_a.copy_(flat_b, non_blocking=True), device, args.repeats)
    del flat_a, flat_b
    torch.cuda.empty_cache()
    live = {n: torch.randn(s, dtype=torch.bfloat16, device=device) for n, s in shapes.items()}
    staging = Staging(live, "device", "a Qwen3-30B-A3B TP shard")  # the worker's own staging and flip
    staged = staging.tensors
    for t in staged.values():
        t.normal_()
    names = list(live)
    dst, src = [live[n] for n in names], [staged[n] for n in names]
    flip = staging.flip

    def batched_flip() -> None:  # the alternative: one torch._foreach_copy_ of every tensor
        torch._foreach_copy_(dst, src, non_blocking=True)

    flip()
    torch.cuda.synchronize(device)
    assert all(torch.equal(live[n], staged[n]) for n in names), "the flip did not land every byte"
    results["flip_s"] = timed(flip, device, args.repeats)
    results["flip_batched_s"] = timed(batched_flip, device, args.repeats)
    del staging, staged, src, flip
    torch.cuda.empty_cache()
    if not args.no_host:
        t0 = time.perf_counter()
        host = {n: torch.empty(s, dtype=torch.bfloat16, pin_memory=True) for n, s in shapes.items()}
        results["pin_alloc_s"] = time.perf_counter() - t0
        hsrc = [host[n] for n in names]
        results["flip_host_s"] = timed(lambda: torch._foreach_copy_(dst, hsrc, non_blocking=True), device,
                                       max(2, args.repeats // 3))
        del host, hsrc
        flat_h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        flat_d = torch.empty(nbytes, dtype=torch.uint8, device=device)
        results["h2d_copy_s"] = timed(lambda: flat_d.copy_(flat_h, non_blocking=True), device,
                                      max(2, args.repeats // 3))
    gb = nbytes / 1e9
    for key in [k for k in results if k.endswith("_s") and isinstance(results[k], list)]:
        med = statistics.median(results[key])
        results[key[:-2] + "_median_s"] = med
        print(f"{key:14s} median {med * 1e3:8.2f} ms  ({gb / med:7.1f} GB/s)  [{gb:.2f} GB, {len(shapes)} tensors]")
    print(f"flip / device copy: {results['flip_median_s'] / results['copy_median_s']:.2f}x on {results['device']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
