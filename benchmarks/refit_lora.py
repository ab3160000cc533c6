"""LoRA refits: the fixed cost per refit beside the bytes, for a rank-16 adapter on Qwen3-8B's shape (all of
linear_qkv, linear_proj, linear_fc1, linear_fc2 adapted; bfloat16), from Megatron-Bridge TP1 tensors into vLLM's
LoRA slot layout (TP1, max_lora_rank 16).

In process (one process holds the trainer's tensors and the engine's slots; the slots are tensors shaped as
vLLM's `lora_a_stacked[s][slot, 0]` views, vLLM itself is not imported):
  compile                first compile of the plan (once per process)
  lookup                 planner.cache.cached_plan on a hit (every refit pays it)
  bind                   SlotRefit's executor: checks and views, once (executors.inprocess)
  refit                  lookup + one batched copy of every block + B *= alpha / r + device sync: end to end
  refit (reference)      the same plan through the reference ReferenceExecutor (checks and a Python loop per refit)
  copy                   ceiling: one device copy of the same bytes
  publish (CPU)          landing (b): the plan into PEFT-named tensors, safetensors + fsync + atomic switch
  tiny adapter           the refit of a two-layer hidden-64 adapter: the fixed cost besides the bytes
Across processes (a trainer process and an engine process, a TCPStore for control): per refit, the trainer asks,
both run the executor, the engine scales B and answers; measured at the trainer from ask to answer:
  control round trip         ask and answer alone, no executor
  shared staged / in place   executors.shared (POSIX shared memory on CPU, CUDA IPC on one GPU)
  collective (CPU)           executors.collective.executor over a gloo group made over the store, in place

    python benchmarks/refit_lora.py [--device cpu|cuda] [--iters 50] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "examples/configs/qwen3-8b.json"
RANK, ALPHA, MAX_RANK = 16, 32, 16


def _layouts(tiny: bool = False):
    import reshard
    from reshard.layouts.lora import VllmLoraLayout, lora_spec
    from reshard.testing.megatron_cpu import TinyGPT

    base = TinyGPT(num_layers=2).spec("bfloat16") if tiny else reshard.ModelSpec.from_hf_config(str(CONFIG))
    spec = lora_spec(base, RANK, ALPHA)
    return spec, reshard.MegatronLayout(model=spec, tp=1), VllmLoraLayout(model=spec, tp=1, max_lora_rank=MAX_RANK)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fill(tensors: dict, device: torch.device, seed: int) -> None:
    g = torch.Generator(device=device).manual_seed(seed)
    for t in tensors.values():
        t.copy_(torch.randn(t.shape, generator=g, device=device, dtype=torch.float32).to(t.dtype))


def _ms(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_ms": statistics.median(xs) * 1e3, "p10_ms": xs[len(xs) // 10] * 1e3,
            "p90_ms": xs[(9 * len(xs)) // 10] * 1e3, "n": len(xs)}


def in_process(device: torch.device, iters: int) -> dict:
    from reshard.executors import allocate, make_executor
    from reshard.executors.inprocess import InProcessExecutor
    from reshard.planner import cache, compile_plan

    spec, src_layout, dst_layout = _layouts()
    out: dict = {"adapter_bytes": spec.num_bytes}
    t0 = time.perf_counter()
    plan = compile_plan(src_layout, dst_layout)
    out["compile_ms"] = (time.perf_counter() - t0) * 1e3
    cache.clear()
    cache.cached_plan(src_layout, dst_layout)
    lookups = []
    for _ in range(iters):
        t0 = time.perf_counter()
        cache.cached_plan(src_layout, dst_layout)
        lookups.append(time.perf_counter() - t0)
    out["lookup"] = _ms(lookups)
    out["moved_bytes"] = plan.accounting.total_bytes
    out["ops"] = plan.num_ops
    src, dst = allocate(src_layout, device=device), allocate(dst_layout, device=device)
    _fill(src[0], device, 0)
    t0 = time.perf_counter()
    ex = InProcessExecutor(plan, None, 0, src, dst)
    b_views = [t for n, t in dst[0].items() if ".lora_b_stacked." in n]
    out["bind_ms"] = (time.perf_counter() - t0) * 1e3
    scale = ALPHA / RANK

    def refit() -> None:
        cache.cached_plan(src_layout, dst_layout)  # what a refit looks its plan up by
        ex.refit()
        torch._foreach_mul_(b_views, scale)  # vLLM keeps B * alpha / r in its slots (SlotRefit.refit does this)
        _sync(device)

    for _ in range(5):
        refit()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        refit()
        times.append(time.perf_counter() - t0)
    out["refit"] = _ms(times)
    dst_ref = allocate(dst_layout, device=device)
    ref = make_executor("reference", plan, None, 0, src, dst_ref)
    ref_b = [t for n, t in dst_ref[0].items() if ".lora_b_stacked." in n]
    times = []
    for k in range(max(5, iters // 5) + 1):
        t0 = time.perf_counter()
        cache.cached_plan(src_layout, dst_layout)
        ref.refit()
        for t in ref_b:
            t.mul_(scale)
        _sync(device)
        if k:
            times.append(time.perf_counter() - t0)
    out["refit (reference ReferenceExecutor)"] = _ms(times)
    ref.refit()  # a refit rewrites every byte of B's data, so the last landing is all that is compared
    for t in ref_b:
        t.mul_(scale)
    ex.refit()
    torch._foreach_mul_(b_views, scale)
    _sync(device)
    out["bound_equals_reference"] = all(torch.equal(dst[0][n], dst_ref[0][n]) for n in dst[0])
    a = torch.empty(out["moved_bytes"], dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        b.copy_(a)
        _sync(device)
        times.append(time.perf_counter() - t0)
    out["copy (same bytes, one device copy)"] = _ms(times)
    if device.type == "cpu":
        out["publish"] = _publish(spec, src_layout, src, max(3, iters // 10))
    return out


def fixed_cost(device: torch.device, iters: int) -> dict:
    """The same refit for a tiny adapter (two layers, hidden 64, rank 16): what a refit costs besides its bytes."""
    from reshard.executors import allocate
    from reshard.executors.inprocess import InProcessExecutor
    from reshard.planner import cache

    spec, src_layout, dst_layout = _layouts(tiny=True)
    plan = cache.cached_plan(src_layout, dst_layout)
    src, dst = allocate(src_layout, device=device), allocate(dst_layout, device=device)
    ex = InProcessExecutor(plan, None, 0, src, dst)
    b_views = [t for n, t in dst[0].items() if ".lora_b_stacked." in n]
    times = []
    for k in range(iters + 5):
        t0 = time.perf_counter()
        cache.cached_plan(src_layout, dst_layout)
        ex.refit()
        torch._foreach_mul_(b_views, ALPHA / RANK)
        _sync(device)
        if k >= 5:
            times.append(time.perf_counter() - t0)
    return {"adapter_bytes": spec.num_bytes, "moved_bytes": plan.accounting.total_bytes, "ops": plan.num_ops,
            **_ms(times)}


def _publish(spec, src_layout, src, iters: int) -> dict:
    from reshard.adapters.lora import PeftDirectory
    from reshard.layouts.lora import PeftLayout
    from reshard.planner import cache

    layout = PeftLayout(model=spec)
    with tempfile.TemporaryDirectory() as tmp:
        directory = PeftDirectory(Path(tmp) / "adapter", layout)
        from reshard.executors.inprocess import InProcessExecutor

        ex = InProcessExecutor(cache.cached_plan(src_layout, layout), None, 0, src, {0: directory.tensors})
        times = []
        for k in range(iters + 1):
            t0 = time.perf_counter()
            ex.refit()
            directory.publish(f"v{k}")
            if k:
                times.append(time.perf_counter() - t0)
        size = sum(f.stat().st_size for f in directory.current().iterdir())
    return {**_ms(times), "directory_bytes": size}


# --- across processes ----------------------------------------------------------------------------------------

TRAINER, ENGINE = 0, 1


def _wait(store, key: str, timeout: float = 600.0) -> None:
    store.wait([key], __import__("datetime").timedelta(seconds=timeout))


def worker(me: int, port: int, args: dict, out: str) -> None:
    import torch.distributed as dist

    from reshard.executors import allocate
    from reshard.executors.binding import Binding
    from reshard.executors.collective.comm import StoreComm
    from reshard.executors.collective.executor import CollectiveExecutor
    from reshard.executors.shared import SharedExecutor, shared_empty
    from reshard.planner import cache

    device = torch.device(args["device"])
    if device.type == "cuda":
        torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    _, src_layout, dst_layout = _layouts()
    plan = cache.cached_plan(src_layout, dst_layout)
    binding = Binding((TRAINER,), (ENGINE,))
    results: dict = {}
    times = []
    for k in range(args["iters"] + 3):  # the control round trip alone: ask and answer, no bytes
        if me == TRAINER:
            t0 = time.perf_counter()
            store.set(f"rt/{k}/ask", "1")
            _wait(store, f"rt/{k}/done")
            if k >= 3:
                times.append(time.perf_counter() - t0)
        else:
            _wait(store, f"rt/{k}/ask")
            store.set(f"rt/{k}/done", "1")
    if me == TRAINER:
        results["control round trip (no bytes)"] = _ms(times)
    cases = [("shared staged", True), ("shared in place", False)]
    if device.type == "cpu":
        cases.append(("collective", None))
    for name, staged in cases:
        src, dst = {}, {}
        if me == TRAINER:
            src = allocate(src_layout, device=device)
            _fill(src[0], device, 0)
        else:
            dst = allocate(dst_layout, device=device)
            if staged is False and device.type == "cpu":
                dst = {0: {n: shared_empty(tuple(t.shape), t.dtype) for n, t in dst[0].items()}}
        if staged is None:
            comm = StoreComm(dist.PrefixStore("coll/", store), me, 2, "gloo", 600.0)
            ex = CollectiveExecutor(plan, binding, me, src, dst, group=comm, in_place=True, timeout=600.0)
        else:
            ex = SharedExecutor(plan, binding, me, src, dst, store=store, staged=staged, timeout=600.0,
                                namespace=name.replace(" ", "-"))
        b_views = [t for n, t in dst.get(0, {}).items() if ".lora_b_stacked." in n]
        times = []
        for k in range(args["iters"] + 3):
            key = f"{name}/{k}"
            if me == TRAINER:
                t0 = time.perf_counter()
                store.set(f"{key}/ask", "1")          # control: the trainer asks the engine to refit
                cache.cached_plan(src_layout, dst_layout)
                ex.refit()
                _sync(device)
                _wait(store, f"{key}/done")             # control: the engine's answer
                if k >= 3:
                    times.append(time.perf_counter() - t0)
            else:
                _wait(store, f"{key}/ask")
                cache.cached_plan(src_layout, dst_layout)
                ex.refit()
                torch._foreach_mul_(b_views, ALPHA / RANK)
                _sync(device)
                store.set(f"{key}/done", "1")
        ex.close()
        if me == TRAINER:
            results[name] = _ms(times)
    if me == TRAINER:
        Path(out).write_text(json.dumps(results))


def across_processes(device: str, iters: int) -> dict:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "out.json")
        procs = [ctx.Process(target=worker, args=(me, store.port, {"device": device, "iters": iters}, out))
                 for me in (TRAINER, ENGINE)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(900)
        if any(p.exitcode != 0 for p in procs):
            return {"error": [p.exitcode for p in procs]}
        return json.loads(Path(out).read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--skip-processes", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    info = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
            "torch": torch.__version__, "model": "Qwen3-8B shape", "rank": RANK, "alpha": ALPHA,
            "max_lora_rank": MAX_RANK, "dtype": "bfloat16"}
    results = {"info": info, "in_process": in_process(device, args.iters),
               "fixed_cost_tiny_adapter": fixed_cost(device, args.iters)}
    if not args.skip_processes:
        results["across_processes"] = across_processes(args.device, max(10, args.iters // 2))
    r = results["in_process"]
    print(f"{info['model']} rank-{RANK} adapter on {info['device']}: {r['adapter_bytes'] / 1e6:.1f} MB of adapter, "
          f"{r['moved_bytes'] / 1e6:.1f} MB into vLLM's slots ({r['ops']} ops); inprocess executor equals "
          f"the reference: {r['bound_equals_reference']}")
    print(f"  compile (first, once)     {r['compile_ms']:9.2f} ms")
    print(f"  bind (once)               {r['bind_ms']:9.2f} ms")
    for key in ("lookup", "refit", "refit (reference ReferenceExecutor)", "copy (same bytes, one device copy)",
                "publish"):
        if key in r:
            print(f"  {key:<34} median {r[key]['median_ms']:8.3f} ms  (p10 {r[key]['p10_ms']:.3f}, "
                  f"p90 {r[key]['p90_ms']:.3f})")
    t = results["fixed_cost_tiny_adapter"]
    print(f"  refit of a tiny adapter ({t['moved_bytes'] / 1e3:.0f} kB, {t['ops']} ops)   median "
          f"{t['median_ms']:8.3f} ms  (p10 {t['p10_ms']:.3f}, p90 {t['p90_ms']:.3f})")
    for key, v in results.get("across_processes", {}).items():
        if isinstance(v, dict):
            print(f"  across processes: {key:<17} median {v['median_ms']:8.3f} ms  (p10 {v['p10_ms']:.3f}, "
                  f"p90 {v['p90_ms']:.3f})")
        else:
            print(f"  across processes: {key} {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
