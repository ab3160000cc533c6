"""One GPU at its ceiling (issue 31): in-process refits, FP8 quantize-and-land, GPU checksums; each figure beside
its ceiling measured in the same run.

Trainer and engine in one process (verl's colocated hybrid engine, an in-process `LLM`): Megatron TP1 tensors of
the model and vLLM TP1 tensors, random bf16 weights. Per model (--configs):
  copy                 ceiling: one copy of the refit's bytes in one flat tensor (device copy; CPU: torch's copy)
  reference            the reference ReferenceExecutor (views built and ops walked in Python at every refit)
  bound, no graph      the inprocess executor (executors.inprocess) with its program run eagerly
  inprocess            the inprocess transport end to end (PublishedSource: the inprocess executor, one CUDA graph)
  bound variants       graph modes and streams; on a GPU the table-copy kernel (kernels.copy_table) for the large
                       copies over KernelTuning's chunk sizes and warps (--table-variants), each variant's bytes
                       checked against the reference (its cache hints, one block in flight and a persistent grid were
                       measured no better and removed: BENCHMARKS.md, Same host, issue 31 fourth run)
With --fp8 (first model only; GPU):
  quantize kernel      the Triton quantizer alone, straight into the engine's fp8 weights and scales; ceiling: its
                       bytes (bf16 read + fp8 write + scales) at the copy's bandwidth
  fp8 refit direct     a whole colocated FP8 refit (kernel, quantized straight into the engine) against the bf16
                       refit of the same model (inprocess above)
  fp8 refit shadows    the same through the wire's shadows and the bound copies (kernel quantizer)
  fp8 receivers        Megatron TP2 (both ranks here) -> vLLM TP1: the trainer's TP cuts the MLP through blocks,
                       so those kinds travel bf16 into staging and the receivers quantize (kernel)
  quantizer variants   KernelTuning's quantizer warps (--quantize-variants), the quantizer alone and the whole
                       direct refit, each one's bytes against the reference
  and the bytes of the direct and shadow refits against the eager reference path, tensor for tensor. The variants
  measured slower and removed (BENCHMARKS.md, FP8, issue 31 sixth round) are no longer swept: a launch per job, the
  float32 amax forms, strips of blocks, side streams for the jobs, and the rest's copies through the table kernel
  beside the quantizer.
  --quick: without the quantizer's variants and the receivers' case.
With --sum64 (the extras model): the "sum64" digest of the refit's source stream (every op's block, plan order)
as a separate pass (checksum.Sum64Program, one graph), against the refit's own time; the torch-ops digest of
the same blocks (the reference, once) must be equal. Then the refit with checksum="sum64" (the inprocess executor
with the copy-and-checksum kernel, kernels.copy_sum64: bytes read once) over KernelTuning's windows and warps,
its digest against the reference and its bytes against the plain refit's, and its time beside the refit's, the
device copy and the separate pass.

Every variant is a `KernelTuning` (reshard.kernels) handed to the executor it runs: no module state is changed.

    python benchmarks/refit_inprocess.py --device cuda --configs qwen3-8b,qwen3-30b-a3b --fp8 --sum64 --json out
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import reshard  # noqa: E402
from reshard.executors.reference import ReferenceExecutor, allocate  # noqa: E402
from reshard.kernels import KernelTuning  # noqa: E402

# the variants swept, as KernelTuning overrides (--table-variants and --quantize-variants replace the first two)
TABLE_VARIANTS = tuple({"copy_chunk_bytes": c << 10, "copy_warps": w} for c, w in
                       ((32, 16), (48, 16), (64, 16), (256, 16), (48, 8)))
QUANTIZE_VARIANTS = tuple({"quantize_warps": w} for w in (4, 8, 16))
SUM64_VARIANTS = tuple({"sum64_window_bytes": k << 10, "sum64_warps": w} for k, w in
                       ((16, 8), (8, 4), (8, 8), (16, 4), (16, 16), (32, 8), (32, 16), (4, 4)))


def named(overrides: dict) -> str:
    """A variant's name: its overrides, byte counts in KiB."""
    return ",".join(f"{k}={v >> 10}K" if k.endswith("bytes") else f"{k}={v}" for k, v in overrides.items())


def bound_executor(plan, src, dst, tuning: KernelTuning, **options):
    """The inprocess executor with its kernels launched with `tuning`; None where the executor does not take a
    tuning yet (it then builds its kernels with KernelTuning()) and `tuning` is another."""
    from reshard.executors.inprocess import InProcessExecutor

    if "tuning" in inspect.signature(InProcessExecutor).parameters:
        return InProcessExecutor(plan, None, 0, src, dst, tuning=tuning, **options)
    if tuning != KernelTuning():
        return None
    return InProcessExecutor(plan, None, 0, src, dst, **options)


def timed(fn, iters: int, device: torch.device, warmup: int = 2) -> list[float]:
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def random_source(layout, device, seed: int = 0) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for r in range(layout.num_ranks):
        out[r] = {}
        for name, shape in layout.rank_tensors(r).items():
            t = torch.empty(shape, dtype=torch.bfloat16, device=device)
            t.normal_(0.0, 0.02, generator=g)
            out[r][name] = t
    return out


def copy_ceiling(nbytes: int, device, iters: int) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    b = torch.empty_like(a)
    t = med(timed(lambda: b.copy_(a), iters, device))
    del a, b
    return t


def equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[r][n].view(torch.uint8), b[r][n].view(torch.uint8)) for r in a for n in a[r])


def bf16_case(config: str, device, iters: int, results: dict, keep: bool, table_variants=TABLE_VARIANTS):
    from reshard.adapters.refit import RefitSpec, open_transport
    from reshard.adapters.transports import publish_source, withdraw_source

    spec = reshard.ModelSpec.from_hf_config(ROOT / "examples/configs" / f"{config}.json")
    src_l, dst_l = reshard.MegatronLayout(model=spec), reshard.VllmLayout(model=spec)
    t0 = time.perf_counter()
    plan = reshard.compile(src_l, dst_l, colocated=True)
    r: dict = {"model": config, "bytes": int(plan.accounting.total_bytes), "ops": int(plan.num_ops),
               "compile_s": time.perf_counter() - t0}
    r["copy_s"] = copy_ceiling(r["bytes"], device, iters)
    src = random_source(src_l, device)
    dst = allocate(dst_l, -7.0, device=device)
    ref = ReferenceExecutor(plan, None, 0, src, dst)
    r["reference_s"] = med(timed(ref.refit, max(3, iters // 4), device, warmup=1))
    want = {0: {n: t.clone() for n, t in dst[0].items()}} if keep or config.endswith("8b") else None
    if want is None:  # too large to keep a second copy: per-tensor sum64 digests of the reference's bytes
        from reshard.executors.checksum import Streams

        def digests() -> dict:
            s = Streams("sum64")
            for n, t in dst[0].items():
                s.update(n, t)
            return {n: s.hexdigest(n) for n in dst[0]}
        want_digest = digests()
    for t in dst[0].values():
        t.fill_(-3.0)
    r["variants_s"] = {}
    combos = [("none", 1, False, {}), ("small", 4, False, {}), ("all", 4, False, {}), ("all", 16, False, {})]
    if device.type == "cuda":  # the table-copy kernel (kernels.copy_table) under each tuning
        combos += [("all", 1, True, t) for t in table_variants]
    else:
        combos = combos[:1]
    for graph, streams, table, overrides in combos:
        name = "table," + named(overrides) if table else f"graph={graph},streams={streams}"
        if table:
            for t in dst[0].values():
                t.fill_(-3.0)
        bound = bound_executor(plan, src, dst, KernelTuning(**overrides), graph=graph, streams=streams, table=table)
        if bound is None:
            r.setdefault("variants_skipped", []).append(name)
            continue
        r["variants_s"][name] = med(timed(bound.refit, iters, device, warmup=3))
        if table:  # each table variant's bytes against the reference too
            r.setdefault("table_equal", {})[name] = equal(dst, want) if want is not None else \
                digests() == want_digest
        r["copies"] = bound.copies
        r["large_copies"] = len(bound._program.large)
        bound.close()
        del bound
        gc.collect()
    r["bound_nograph_s"] = r["variants_s"]["graph=none,streams=1"]
    for t in dst[0].values():
        t.fill_(-5.0)
    refit = RefitSpec.of(spec, src_l, dst_l, transport="inprocess", options={"key": "bench"})
    publish_source("bench", src)
    ex = open_transport(refit, 0, {}, dst)
    r["inprocess_s"] = med(timed(ex.refit, iters, device, warmup=3))
    r["graph"] = ex._bound._run.graph is not None
    r["graph_mode"] = ex._bound.graph
    r["table"] = ex._bound._table is not None
    r["graph_error"] = ex._bound._run.error
    r["inprocess_equals_reference"] = equal(dst, want) if want is not None else digests() == want_digest
    r["inprocess_of_copy"] = r["copy_s"] / r["inprocess_s"]
    results.setdefault("bf16", []).append(r)
    print(f"{config}: {r['bytes'] / 2**30:.2f} GiB, {r['ops']} ops ({r['copies']} copies bound): copy "
          f"{r['copy_s'] * 1e3:.2f} ms | reference {r['reference_s'] * 1e3:.2f} ms "
          f"({r['copy_s'] / r['reference_s']:.0%}) | bound no graph {r['bound_nograph_s'] * 1e3:.2f} ms "
          f"({r['copy_s'] / r['bound_nograph_s']:.0%}) | inprocess {r['inprocess_s'] * 1e3:.2f} ms "
          f"({r['inprocess_of_copy']:.0%}) | equal {r['inprocess_equals_reference']} graph {r['graph']} "
          f"table {r['table']} (variants equal: {r.get('table_equal')})", flush=True)
    if r.get("variants_skipped"):
        print(f"  skipped (the inprocess executor takes no tuning yet): {r['variants_skipped']}", flush=True)
    print("  bound variants: " + ", ".join(f"{k} {v * 1e3:.2f} ms ({r['copy_s'] / v:.0%})"
                                         for k, v in r["variants_s"].items()), flush=True)
    ctx = {"spec": spec, "plan": plan, "src": src, "dst": dst, "ex": ex, "src_l": src_l, "dst_l": dst_l}
    withdraw_source("bench")
    del ref, want
    return ctx, r


def quantize_variants(fp, src, device, iters: int, r: dict, reference, variants) -> None:
    """Each of `variants` (KernelTuning overrides): the quantizer alone and the whole direct refit, its bytes
    against the reference's."""
    from reshard.executors.fp8 import Fp8Executor

    r["quantize_variants_s"], r["refit_variants_s"], r["variants_equal"] = {}, {}, {}
    for overrides in variants:
        name = named(overrides)
        dst8 = allocate(fp.full_dst, -7.0, device=device)
        ex = Fp8Executor(fp, None, 0, src, dst8, inner="inprocess", quantizer="kernel", direct=True,
                         tuning=KernelTuning(**overrides))
        r["quantize_variants_s"][name] = med(timed(lambda: ex.direct.run(ex.quantize), iters, device, 3))
        r["refit_variants_s"][name] = med(timed(ex.refit, iters, device, warmup=3))
        r["variants_equal"][name] = equal(dst8, reference)
        ex.close()
        del dst8
        print(f"  quantizer {name}: {r['quantize_variants_s'][name] * 1e3:.2f} ms, refit "
              f"{r['refit_variants_s'][name] * 1e3:.2f} ms, equal {r['variants_equal'][name]}", flush=True)


def fp8_case(ctx: dict, bf: dict, device, iters: int, results: dict, quick: bool = False,
             variants=QUANTIZE_VARIANTS, sweep: bool = False) -> None:
    """The FP8 figures (module doc); `variants` swept unless `quick` (`sweep`: with `quick` too)."""
    from reshard.executors.fp8 import Fp8Executor
    from reshard.layouts.fp8 import Fp8Scheme
    from reshard.planner.fp8 import compile_fp8

    spec, src, src_l, dst_l = ctx["spec"], ctx["src"], ctx["src_l"], ctx["dst_l"]
    del ctx["dst"], ctx["ex"]
    gc.collect()
    torch.cuda.empty_cache()
    fp = compile_fp8(src_l, dst_l, Fp8Scheme(), colocated=True)
    copy_bw = 2 * bf["bytes"] / bf["copy_s"]  # bytes read + written per second, this run
    r: dict = {"model": bf["model"], "where": sorted(set(fp.where.values()))}
    out = {}
    for tag, quantizer, direct in (("direct", "kernel", True), ("shadows", "kernel", False),
                                   ("reference", "eager", False)):
        dst8 = allocate(fp.full_dst, -7.0, device=device)
        ex = Fp8Executor(fp, None, 0, src, dst8, inner="inprocess", quantizer=quantizer, direct=direct)
        r[f"refit_{tag}_s"] = med(timed(ex.refit, iters if tag != "reference" else 3, device, warmup=3))
        if tag == "direct":
            jobs = ex.direct.jobs
            elements = sum(x.numel() for x, _, _ in jobs)
            scales = sum(s.numel() for _, _, s in jobs)
            r["quantized_elements"] = elements
            r["quantize_bytes"] = elements * 3 + scales * 4  # bf16 read + fp8 write + scales
            r["quantize_s"] = med(timed(lambda: ex.direct.run(ex.quantize), iters, device, warmup=3))
            r["quantize_ceiling_s"] = r["quantize_bytes"] / copy_bw
            r["rest_bytes"] = ex.inner.bytes
            r["graph"] = ex.direct._kernel.graph is not None
        out[tag] = dst8
        ex.close()
    if variants and (not quick or sweep):
        quantize_variants(fp, src, device, iters, r, out["reference"], variants)
    r["direct_equals_reference"] = equal(out["direct"], out["reference"])
    r["shadows_equal_reference"] = equal(out["shadows"], out["reference"])
    del out
    torch.cuda.empty_cache()
    r["bf16_refit_s"] = bf["inprocess_s"]
    r["direct_over_bf16"] = r["refit_direct_s"] / bf["inprocess_s"]
    r["quantize_of_hbm"] = r["quantize_ceiling_s"] / r["quantize_s"]
    print(f"fp8 {bf['model']}: quantize kernel {r['quantize_s'] * 1e3:.2f} ms for "
          f"{r['quantized_elements'] / 1e9:.2f} G "
          f"elements, ceiling {r['quantize_ceiling_s'] * 1e3:.2f} ms at the copy's {copy_bw / 1e12:.2f} TB/s "
          f"({r['quantize_of_hbm']:.0%}) | refit direct {r['refit_direct_s'] * 1e3:.2f} ms = "
          f"{r['direct_over_bf16']:.3f}x bf16 inprocess {bf['inprocess_s'] * 1e3:.2f} ms | shadows "
          f"{r['refit_shadows_s'] * 1e3:.2f} ms | eager reference {r['refit_reference_s'] * 1e3:.2f} ms | equal "
          f"{r['direct_equals_reference']}/{r['shadows_equal_reference']}", flush=True)
    results["fp8"] = r
    if quick:
        return
    # receivers quantize: Megatron TP2 (both ranks in this process) -> vLLM TP1
    del ctx["src"], src
    gc.collect()
    torch.cuda.empty_cache()
    spec = reshard.ModelSpec(**{**spec.model_dump(), "intermediate_size": spec.intermediate_size + 128})
    dst_l = reshard.VllmLayout(model=spec)  # intermediate + 128: a TP2 trainer cuts the MLP through blocks
    src2_l = reshard.MegatronLayout(model=spec, tp=2)
    fp2 = compile_fp8(src2_l, dst_l, Fp8Scheme(), colocated=True)
    src2 = random_source(src2_l, device, seed=1)
    q: dict = {"where": {k.split(".")[-2]: v for k, v in fp2.where.items()}}
    outs = {}
    for tag, quantizer in (("kernel", "kernel"), ("reference", "eager")):
        dst8 = allocate(fp2.full_dst, -7.0, device=device)
        ex = Fp8Executor(fp2, None, 0, src2, dst8, inner="inprocess", quantizer=quantizer)
        q[f"refit_{tag}_s"] = med(timed(ex.refit, iters if tag == "kernel" else 3, device, warmup=3))
        if tag == "kernel":
            jobs = ex.receivers.jobs
            elements = sum(x.numel() for x, _, _ in jobs)
            q["receiver_elements"] = elements
            q["receivers_s"] = med(timed(lambda: ex.receivers.run(ex.quantize, direct=True), iters, device, 3))
            q["receivers_ceiling_s"] = (elements * 3 + sum(s.numel() for _, _, s in jobs) * 4) / copy_bw
            q["direct"] = ex.direct is not None
        outs[tag] = dst8
        ex.close()
    q["kernel_equals_reference"] = equal(outs["kernel"], outs["reference"])
    del outs
    plan2 = reshard.compile(src2_l, dst_l, colocated=True)
    dst16 = allocate(dst_l, -7.0, device=device)
    from reshard.executors.inprocess import InProcessExecutor

    b16 = InProcessExecutor(plan2, None, 0, src2, dst16)
    q["bf16_refit_s"] = med(timed(b16.refit, iters, device, warmup=3))
    q["kernel_over_bf16"] = q["refit_kernel_s"] / q["bf16_refit_s"]
    q["receivers_of_hbm"] = q["receivers_ceiling_s"] / q["receivers_s"]
    print(f"fp8 receivers (Megatron TP2 -> vLLM TP1, intermediate {spec.intermediate_size}, {q['where']}): refit "
          f"{q['refit_kernel_s'] * 1e3:.2f} ms = "
          f"{q['kernel_over_bf16']:.3f}x bf16 {q['bf16_refit_s'] * 1e3:.2f} ms; receivers' kernel "
          f"{q['receivers_s'] * 1e3:.2f} ms for {q['receiver_elements'] / 1e9:.2f} G elements "
          f"({q['receivers_of_hbm']:.0%} of HBM) | eager reference {q['refit_reference_s'] * 1e3:.2f} ms | equal "
          f"{q['kernel_equals_reference']}", flush=True)
    results["fp8_receivers"] = q


def sum64_case(ctx: dict, bf: dict, device, iters: int, results: dict) -> None:
    from reshard.executors.checksum import Sum64Program, _Sum64
    from reshard.executors.reference import block

    plan, src = ctx["plan"], ctx["src"]
    o = plan.ops
    flat = {i: src[r][n].view(-1) for i, (r, n) in enumerate(zip(plan.src_tensors.ranks, plan.src_tensors.names))}
    blocks = [block(flat[int(o["src_tensor"][i])], int(o["src_offset"][i]), int(o["rows"][i]), int(o["cols"][i]),
                    int(o["src_stride"][i])) for i in range(plan.num_ops)]
    program = Sum64Program(blocks)
    got = program.hexdigest()
    r: dict = {"blocks": len(blocks), "bytes": bf["bytes"]}
    r["kernel_s"] = med(timed(program.hexdigest, iters, device, warmup=2))
    t0 = time.perf_counter()
    ref = _Sum64()
    for b in blocks:  # the torch ops, as before the kernel
        ref.update(b.contiguous().view(-1).view(torch.uint8))
    want = ref.digest().hex()
    r["torch_ops_s"] = time.perf_counter() - t0
    r["equal"] = got == want
    r["refit_s"] = bf["inprocess_s"]
    r["kernel_over_refit"] = r["kernel_s"] / r["refit_s"]
    r["read_of_hbm"] = (bf["bytes"] / r["kernel_s"]) / (2 * bf["bytes"] / bf["copy_s"])
    print(f"sum64 over {len(blocks)} blocks ({bf['bytes'] / 2**30:.2f} GiB): separate pass "
          f"{r['kernel_s'] * 1e3:.2f} ms "
          f"= {r['kernel_over_refit']:.2f}x the refit ({r['refit_s'] * 1e3:.2f} ms), reads at {r['read_of_hbm']:.0%} "
          f"of the copy's bandwidth | torch ops {r['torch_ops_s'] * 1e3:.0f} ms | equal {r['equal']}", flush=True)
    # the refit with checksum="sum64": copies and digest in one kernel (kernels.copy_sum64), against the refit
    from reshard.executors.inprocess import InProcessExecutor
    from reshard.kernels.copy_sum64 import CopySum64

    dst = ctx["dst"]
    InProcessExecutor(plan, None, 0, src, dst).refit()  # the plain refit's bytes, to compare against
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    want_bytes = {0: {n: t.clone() for n, t in dst[0].items()}}
    r["fused_variants_s"], r["fused_equal"], tunings = {}, {}, {}
    for overrides in SUM64_VARIANTS:
        name = named(overrides)
        tunings[name] = KernelTuning(**overrides)
        for t in dst[0].values():
            t.fill_(-3.0)
        try:
            ex = bound_executor(plan, src, dst, tunings[name], checksum="sum64")
            if ex is None:
                r["fused_variants_s"][name], r["fused_equal"][name] = None, "skipped: the executor takes no tuning"
                continue
            digest = ex.refit().digest
            r["fused_variants_s"][name] = med(timed(ex.refit, iters, device, warmup=3))
            r["fused_equal"][name] = (digest == want, equal(dst, want_bytes))
            r["fused_graph"] = ex._run.graph is not None
            ex.close()
        except Exception as e:  # a tuning that does not compile (registers): recorded, the others still run
            r["fused_variants_s"][name] = None
            r["fused_equal"][name] = repr(e)[:300]
    del want_bytes
    ok = {k: v for k, v in r["fused_variants_s"].items() if v}
    best = min(ok, key=ok.get)
    r["fused_best"], r["fused_s"] = best, ok[best]
    r["fused_extra_over_refit"] = (r["fused_s"] - r["refit_s"]) / r["refit_s"]
    r["fused_of_copy"] = bf["copy_s"] / r["fused_s"]
    # the kernel's own ceiling: one flat copy of 4 GiB with its digest, against torch's copy of the same bytes
    import numpy as np

    n = 4 << 30
    a = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    b = torch.empty_like(a)
    k = CopySum64(np.asarray([[a.data_ptr(), b.data_ptr(), n, 0]], dtype=np.int64), device, n, tunings[best])
    r["flat_bytes"] = n
    r["flat_fused_s"] = med(timed(lambda: (k.launch(), k.digest()), iters, device, warmup=3))
    r["flat_copy_s"] = med(timed(lambda: b.copy_(a), iters, device, warmup=3))
    del a, b, k
    print(f"flat 4 GiB: copy-and-sum {r['flat_fused_s'] * 1e3:.2f} ms, torch copy {r['flat_copy_s'] * 1e3:.2f} ms "
          f"({r['flat_copy_s'] / r['flat_fused_s']:.0%})", flush=True)
    print(f"refit with checksum='sum64' (one copy-and-sum kernel), best {best}: {r['fused_s'] * 1e3:.2f} ms = refit "
          f"+ {r['fused_extra_over_refit']:.2f}x (refit {r['refit_s'] * 1e3:.2f} ms, device copy "
          f"{bf['copy_s'] * 1e3:.2f} ms: {r['fused_of_copy']:.0%} of it; separate pass {r['kernel_s'] * 1e3:.2f} ms) "
          f"| variants: " + ", ".join(f"{k} {v * 1e3:.2f} ms" if v else f"{k} not run"
                                      for k, v in r["fused_variants_s"].items())
          + f" | equal (digest, bytes): {r['fused_equal']}", flush=True)
    results["sum64"] = r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--configs", default="qwen3-8b")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--extras-config", default="qwen3-8b", help="the model --fp8 and --sum64 run on")
    ap.add_argument("--sum64", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true",
                    help="--fp8 without the receivers' case and the default quantizer variants")
    ap.add_argument("--table-variants", help="JSON list of KernelTuning overrides for the table-copy kernel "
                    "(copy_chunk_bytes, copy_block_bytes, copy_warps) to sweep")
    ap.add_argument("--quantize-variants", help="JSON list of KernelTuning overrides for the quantizer "
                    "(quantize_warps) to sweep; swept with --quick too")
    args = ap.parse_args()
    table_variants = json.loads(args.table_variants) if args.table_variants else TABLE_VARIANTS
    quantize_variants_ = json.loads(args.quantize_variants) if args.quantize_variants else QUANTIZE_VARIANTS
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
    results: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "torch": torch.__version__, "threads": torch.get_num_threads(), "iters": args.iters}
    try:
        import triton
        results["triton"] = triton.__version__
    except ImportError:
        pass
    for config in args.configs.split(","):
        ctx, bf = bf16_case(config, device, args.iters, results, keep=False, table_variants=table_variants)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1, default=str))
        if config == args.extras_config and args.sum64 and device.type == "cuda":
            sum64_case(ctx, bf, device, args.iters, results)
        if config == args.extras_config and args.fp8 and device.type == "cuda":
            fp8_case(ctx, bf, device, args.iters, results, args.quick, quantize_variants_,
                     sweep=bool(args.quantize_variants))
        del ctx
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
