"""bf16 refit against FP8 refit (sender-side quantization) of one model on one device, beside device-copy ceilings.

The colocated shape (E4-like): a trainer's Megatron TP1 tensors and an engine's vLLM TP1 tensors on the same GPU,
both in this process (the local executor: every op a device copy). Cases, each the median of --iters:
  copy bf16        ceiling: one device copy of the bf16 model's bytes (one flat tensor)
  refit bf16       the plan Megatron TP1 -> vLLM TP1, bf16 into bf16 (what an unquantized engine takes)
  copy fp8 wire    ceiling: one device copy of the FP8 refit's wire bytes (fp8 weights, scales, bf16 rest)
  quantize         the senders' quantization alone: eager or torch.compile into the wire's shadows, or the Triton
                   kernel straight into the engine's fp8 weights and scales (issue 31; refit_inprocess.py has more)
  move fp8         the FP8 plan's copies alone (fp8 + scales + bf16 rest into the engine's tensors; shadow paths)
  refit fp8        quantize + move: a whole FP8 refit, eager, torch.compile or kernel
It checks the FP8 engine's layer-0 qkv_proj (weight and scales) against the reference quantizer on the CPU, and
prints what a link of a given bandwidth would make of the two refits (computed from the measured quantize time
and the wire bytes, not measured: one GPU here).

    python benchmarks/refit_fp8.py [--config examples/configs/qwen3-8b.json] [--iters 10] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import _harness_path  # noqa: E402,F401 - tests/ (the harness) on the path, here and in children

import reshard  # noqa: E402
from reshard.executors.fp8 import Fp8Executor  # noqa: E402
from reshard.executors.reference import ReferenceExecutor, allocate  # noqa: E402
from reshard.layouts.fp8 import Fp8Scheme  # noqa: E402
from reshard.planner.fp8 import compile_fp8  # noqa: E402
from harness.fp8_reference import reference_quantize, same_bytes  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, iters: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def canonical(layout, tensors, spec, name: str) -> torch.Tensor:
    """A canonical tensor read back from one rank's physical tensors (its placements on rank 0)."""
    t = spec.tensor(name)
    w = torch.empty(t.shape, dtype=torch.bfloat16)
    for p in layout.placements(t):
        if p.rank == 0 and all(p.lengths):
            src = tensors[0][p.tensor]
            view = src[tuple(slice(o, o + n) for o, n in zip(p.phys_offset[-2:], p.lengths))] if src.dim() == 2 \
                else src[p.phys_offset[0]]
            w[tuple(slice(o, o + n) for o, n in zip(p.canon_offset, p.lengths))] = view.cpu()
    return w


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "examples/configs/qwen3-8b.json"))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json")
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a dry run of the script)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    spec = reshard.ModelSpec.from_hf_config(args.config)
    src_l, dst_l = reshard.MegatronLayout(model=spec), reshard.VllmLayout(model=spec)
    scheme = Fp8Scheme()
    plan = reshard.compile(src_l, dst_l, colocated=True)
    fp = compile_fp8(src_l, dst_l, scheme, colocated=True)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    results: dict = {"model": str(spec), "device": name, "torch": torch.__version__,
                     "iters": args.iters, "bf16_wire_bytes": int(plan.accounting.total_bytes),
                     "fp8_wire_bytes": fp.wire_bytes, "fp8_baseline_bytes": fp.baseline_bytes,
                     "where": sorted(set(fp.where.values())), "quantized_elements": sum(fp.quantize_elements[0])}

    torch.manual_seed(0)
    src = {0: {}}
    for name, shape in src_l.rank_tensors(0).items():
        src[0][name] = (torch.randn(shape, device=dev, dtype=torch.float32) * 0.02).to(torch.bfloat16)
    dst16 = allocate(dst_l, 0.0, device=dev)
    dst8 = allocate(fp.full_dst, 0.0, device=dev)

    flat = torch.empty(plan.accounting.total_bytes // 2, dtype=torch.bfloat16, device=dev)
    flat2 = torch.empty_like(flat)
    results["copy_bf16"] = timed(lambda: flat2.copy_(flat), args.iters)
    wire8 = torch.empty(fp.wire_bytes, dtype=torch.uint8, device=dev)
    wire8b = torch.empty_like(wire8)
    results["copy_fp8_wire"] = timed(lambda: wire8b.copy_(wire8), args.iters)
    del flat, flat2, wire8, wire8b

    bf16 = ReferenceExecutor(plan, None, 0, src, dst16)
    results["refit_bf16"] = timed(bf16.refit, args.iters)

    for tag in ("eager", "kernel"):
        try:  # eager: the wire's shadows, then the plan's copies; kernel: the Triton kernel, straight
            # into the engine's tensors where the plan allows (executors.fp8.DirectQuantizer)
            ex = Fp8Executor(fp, None, 0, src, dst8, quantizer=tag, direct=tag == "kernel")
            results[f"refit_fp8_{tag}"] = timed(ex.refit, args.iters)
            if ex.direct is not None:
                results[f"quantize_{tag}"] = timed(lambda: ex.direct.run(ex.quantize), args.iters)
            else:
                results[f"quantize_{tag}"] = timed(lambda: ex.senders.run(ex.quantize), args.iters)
                results[f"move_fp8_{tag}"] = timed(ex.inner.refit, args.iters)
            ex.refit()
            sync()
            name = "model.layers.0.self_attn."
            parts = [canonical(src_l, src, spec, f"{name}{p}_proj.weight") for p in "qkv"]
            q, s = zip(*(reference_quantize(w, scheme.block) for w in parts))
            results[f"check_{tag}"] = bool(same_bytes(dst8[0][name + "qkv_proj.weight"], torch.cat(q)) and
                                          same_bytes(dst8[0][name + "qkv_proj.weight_scale_inv"], torch.cat(s)))
            ex.close()
        except Exception as e:  # noqa: BLE001 - recorded (Triton may be missing on a machine)
            results[f"error_{tag}"] = f"{type(e).__name__}: {str(e)[:500]}"
    results["peak_memory_bytes"] = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None

    med = {k: statistics.median(v) for k, v in results.items() if isinstance(v, list) and v and
           isinstance(v[0], float)}
    results["median_seconds"] = med
    gib = 2 ** 30
    print(f"{results['model']} on {results['device']} (torch {results['torch']}), median of {args.iters}")
    print(f"  wire bytes  bf16 {results['bf16_wire_bytes'] / gib:.2f} GiB, fp8 {results['fp8_wire_bytes'] / gib:.2f} "
          f"GiB ({results['fp8_wire_bytes'] / results['bf16_wire_bytes']:.3f}x); quantize on {results['where']}")
    for k, v in med.items():
        nbytes = results["bf16_wire_bytes"] if "bf16" in k else results["fp8_wire_bytes"]
        print(f"  {k:22s} {v * 1e3:9.2f} ms   {2 * nbytes / v / 1e12:6.2f} TB/s (read + write of its wire bytes)")
    for tag in ("eager", "kernel"):
        if f"refit_fp8_{tag}" in med:
            print(f"  fp8 / bf16 refit ({tag}): {med[f'refit_fp8_{tag}'] / med['refit_bf16']:.3f}x; checks: "
                  f"{results.get(f'check_{tag}')}")
        if f"error_{tag}" in results:
            print(f"  {tag}: {results[f'error_{tag}']}")
    proj = {}
    for label, bw in (("400 Gb/s NIC (50 GB/s)", 50e9), ("NVLink one direction (366 GB/s)", 366e9)):
        valid = [med[f"quantize_{t}"] for t in ("eager", "kernel") if results.get(f"check_{t}")]
        q = min(valid) if valid else med.get("quantize_eager", float("nan"))  # a quantizer whose bytes checked
        b16 = results["bf16_wire_bytes"] / bw
        f8 = q + results["fp8_wire_bytes"] / bw
        proj[label] = {"bf16_seconds": b16, "fp8_seconds_unoverlapped": f8, "ratio": f8 / b16}
        print(f"  computed over {label}: bf16 {b16 * 1e3:.1f} ms, fp8 {f8 * 1e3:.1f} ms (quantize not overlapped) "
              f"= {f8 / b16:.3f}x")
    results["computed_link_projection"] = proj
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
