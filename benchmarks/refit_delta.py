"""Delta refits against dense ones, side by side in one run (issue 41, item 6): bytes on the wire and refit time.

Default (CPU, gloo over loopback; with --link RATE across the test bed's two hosts, network namespaces joined by a
veth pair that tc limits to RATE both ways, tests/testbed/two_hosts.py, root): two processes, a trainer (Megatron
TP1 source tensors) and an engine (vLLM TP1 destination tensors), joined in a store-made gloo group
(executors.collective.comm.StoreComm). Cases:
  dense                 the collective executor without `delta` (staged): the dense ceiling of this run
  delta p               the same executor with delta=DeltaPolicy(...) after a keyframe, with a fraction p of the
                        trainer's bf16 elements changed since the engine's version (uniformly spread, each by one
                        ulp: the last mantissa bit flipped, as 80-88% of real changes are; BENCHMARKS.md, Delta
                        refits, item 1), for p in --fractions (the measured 2.35% / 4.56% / 8.76% of lr 1e-6 / 3e-6
                        / 1e-5 and 0.1%, 1%, 2.5%, 10%, 50%)
Per case: bytes the trainer sent (payloads with their headers for delta), their share of dense, the encodings chosen
(ops dense / sparse / bitmap / unchanged), the refit's wall time (median of --iters, slowest process; a fresh change
before every timed refit, made outside the timing) and its phases. After each fraction the engine checks its tensors
against a dense refit of the same source into fresh tensors, byte for byte.

With --apply (GPU, imports only torch, numpy and Triton: loads reshard/kernels/delta_apply.py by its path): the apply
kernel alone on one GPU. A bf16 destination of --numel elements (rows of --cols) receives p of its elements
through kernels.delta_apply.scatter (box-local int32 indices, as a payload carries them), against the dense in-place
copy of the whole tensor (the ceiling the kernel must beat) and torch's index_put_ with int64 positions; median of
--iters CUDA-event timings, and the kernel's result checked against index_put_'s.

With --gpu (one GPU): one process holds the trainer's TP1 shard and the engine's TP1 tensors on the GPU (a colocated
plan: every payload local), so a delta refit's GPU work is timed alone (scan and encoding, proof, apply kernel),
with the payload's trip through pinned host memory beside it; the refit over a link of --rate Gbit/s is predicted
as that work plus the delta's bytes at the rate, against the dense bytes at the same rate.

With --gpu --link RATE (one GPU, root): the two-process run above with the trainer's and the engine's tensors both
on GPU 0, joined by NCCL across the test bed's tc-limited link: each process tells NCCL it is a host of its own
(NCCL_HOSTID; NCCL refuses two ranks of one host on one GPU), so NCCL moves every byte over the veth's sockets
through host memory, as between two machines without GPUDirect. The refit measured end to end, with the link's
ceiling (one send of up to 1 GiB over the same group) in the same run. Run it under MPS (`nvidia-cuda-mps-control
-d`): without it the two contexts take turns on the GPU while one spins in an NCCL receive, and the run measures
that (BENCHMARKS.md).

    python benchmarks/refit_delta.py --json out.json                 # CPU, gloo loopback
    python benchmarks/refit_delta.py --link 10gbit --json out.json   # two hosts (namespaces), tc-limited link
    python benchmarks/refit_delta.py --apply --numel 536870912 --json out.json   # one GPU
    python benchmarks/refit_delta.py --gpu --config examples/configs/qwen3-8b.json --json out.json   # one GPU
    python benchmarks/refit_delta.py --gpu --link 10gbit --burst 10mbit --config examples/configs/qwen3-8b.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
FRACTIONS = (0.001, 0.01, 0.0235, 0.025, 0.0456, 0.0876, 0.10, 0.50)
TRAINER, ENGINE = 0, 1


# --- CPU: two processes over gloo ----------------------------------------------------------------
def _spec(args: dict):
    import reshard

    if args.get("config"):
        return reshard.ModelSpec.from_hf_config(args["config"]).model_copy(update={"dtype": "bfloat16"})
    h = args["hidden"]
    return reshard.ModelSpec(family="qwen3", hidden_size=h, num_layers=args["layers"], num_attention_heads=h // 64,
                             num_key_value_heads=max(1, h // 256), head_dim=64, intermediate_size=args["ffn"],
                             vocab_size=args["vocab"], qk_norm=True, dtype="bfloat16")


def _change(src: dict, fraction: float, seed: int) -> None:
    """Flip the last mantissa bit of each element of every source tensor with probability `fraction` (one ulp), in
    place, drawn on the tensors' device."""
    g = None
    for r in sorted(src):
        for name in sorted(src[r]):
            bits = src[r][name].view(-1).view(torch.int16)
            g = g or torch.Generator(device=bits.device).manual_seed(seed)
            bits[torch.rand(bits.numel(), generator=g, device=bits.device) < fraction] ^= 1


def worker(me: int, port: int, args: dict, out: str, host: str = "127.0.0.1") -> None:
    """One process of a two-process run: the trainer (me=0) or the engine (me=1), on the CPU over gloo or, with
    args["device"] "cuda", on the GPU over NCCL (in place, no staging: both processes share one GPU's memory)."""
    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(1)
    import torch.distributed as dist

    import reshard
    from reshard.executors import allocate
    from reshard.executors.binding import Binding
    from reshard.executors.collective.comm import StoreComm
    from reshard.executors.collective.executor import CollectiveExecutor
    from reshard.executors.delta import DeltaPolicy

    gpu = args.get("device") == "cuda"
    dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(dev)
    spec = _spec(args)
    plan = reshard.compile(reshard.MegatronLayout(model=spec), reshard.VllmLayout(model=spec))
    binding = Binding.disjoint(1, 1)
    master = me == TRAINER and args.get("link")  # across the test bed's hosts the trainer holds the store
    store = dist.TCPStore(host, port, is_master=bool(master), wait_for_workers=False, timeout=timedelta(seconds=600))
    comm = StoreComm(dist.PrefixStore("bench/", store), me, 2, "nccl" if gpu else "gloo", 600.0)
    if me == TRAINER:
        g = torch.Generator(device=dev).manual_seed(0)
        src = {r: {n: (torch.randn(t.shape, generator=g, device=dev) * 0.02).to(torch.bfloat16)
                   for n, t in ts.items()} for r, ts in allocate(plan.src, device="meta").items()}
        dst = {}
    else:
        src, dst = {}, allocate(plan.dst, device=dev)
    options = {"group": comm, "timeout": 600.0, **({"in_place": True} if gpu else {})}
    dense = CollectiveExecutor(plan, binding, me, src, dst, **options)
    delta = CollectiveExecutor(plan, binding, me, src, dst, delta=DeltaPolicy(keyframe_every=1 << 30), **options)
    results: dict = {"bytes": plan.accounting.total_bytes, "params": sum(t.numel for t in spec.tensors)}

    def timed(run) -> tuple[float, object]:
        if gpu:  # the change made before is not the refit's time
            torch.cuda.synchronize()
        store.add(f"go/{timed.n}", 1)
        while int(store.add(f"go/{timed.n}", 0)) < 2:  # both start together
            time.sleep(0.001)
        timed.n += 1
        t0 = time.perf_counter()
        stats = run()
        if gpu:
            torch.cuda.synchronize()
        return time.perf_counter() - t0, stats
    timed.n = 0

    # the link's ceiling in this run: one buffer of the dense refit's size (at most 1 GiB) sent over the same group
    wire = torch.ones(min(results["bytes"], 1 << 30), dtype=torch.uint8, device=dev)
    lane = comm.lanes[0]
    if me == TRAINER:
        move = lambda: lane.send([wire], ENGINE, 0).wait()  # noqa: E731
    else:
        move = lambda: lane.recv([wire], TRAINER, 0).wait()  # noqa: E731
    move()  # warm-up (connections)
    results["raw"] = [{"seconds": timed(move)[0], "sent": wire.numel()} for _ in range(args["iters"])]
    del wire
    free = torch.cuda.empty_cache if gpu else lambda: None  # both processes share one GPU's memory
    free()
    dense.refit()  # warm-up (buffers, connections)
    results["dense"] = []
    for _ in range(args["iters"]):
        seconds, stats = timed(dense.refit)
        results["dense"].append({"seconds": seconds, "sent": sum(stats.bytes_sent.values()), "phases": stats.phases})
    dense.release()
    free()
    delta.refit()  # the keyframe: the sender's copy and the engine's version
    if me == TRAINER:
        _change(src, 0.01, seed=1)
    delta.refit()  # warm-up: a first delta (the GPU kernels compiled outside the timing)
    delta.release()  # the keyframe's buffers (the sender's copy and the versions stay)
    free()
    for p in args["fractions"]:
        rows = []
        for i in range(args["iters"]):
            if me == TRAINER:
                _change(src, p, seed=int(p * 1e6) * 100 + i)
            seconds, stats = timed(delta.refit)
            rep = delta.last_delta
            assert not rep.keyframe
            rows.append({"seconds": seconds, "sent": sum(stats.bytes_sent.values()), "phases": stats.phases,
                         "ops": rep.ops, "changed": rep.changed, "wire": rep.wire_bytes, "dense": rep.dense_bytes})
        free()
        if me == ENGINE:  # byte for byte against a dense refit of the same source into fresh tensors
            check = allocate(plan.dst, device=dev)
            CollectiveExecutor(plan, binding, me, src, check, **options).refit()
            same = all(torch.equal(dst[r][n].view(torch.int16), check[r][n].view(torch.int16))
                       for r in dst for n in dst[r])
            rows.append({"equal_to_dense": same})
            del check
        else:
            CollectiveExecutor(plan, binding, me, src, {}, **options).refit()
            rows.append({})
        free()
        results[f"delta {p:g}"] = rows
    Path(out).write_text(json.dumps(results))
    comm.close()


def run_pair(a) -> int:
    """Two processes, trainer and engine: on the CPU (gloo), or with --gpu both on GPU 0 (NCCL; needs --link: each
    process on a host of its own, so that NCCL, told by NCCL_HOSTID that they are two hosts, joins them over the
    link's sockets instead of refusing two ranks on one GPU)."""
    import torch.distributed as dist

    args = {"config": a.config, "hidden": a.hidden, "layers": a.layers, "ffn": a.ffn, "vocab": a.vocab,
            "iters": a.iters, "fractions": a.fractions, "link": a.link, "device": "cuda" if a.gpu else "cpu"}
    outs = [f"/tmp/refit_delta_{os.getpid()}_{me}.json" for me in (TRAINER, ENGINE)]
    if a.link:  # trainer and engine on the test bed's two hosts (network namespaces), the link rate-limited by tc
        sys.path.insert(0, str(ROOT / "tests"))
        from testbed.two_hosts import TwoHosts

        port = 29000 + os.getpid() % 1000
        with TwoHosts(rate=a.link, burst=a.burst) as hosts:
            # NCCL over the veth's sockets only, with several streams (a single one stays under 10 Gbit/s)
            nccl = {"NCCL_SOCKET_IFNAME": os.path.commonprefix([hosts.a.interface, hosts.b.interface]),
                    "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "2"}
            procs = [hosts.start(h, [sys.executable, __file__, "--worker", str(me), "--store",
                                     f"{hosts.a.address}:{port}", "--args", json.dumps(args), "--out", outs[me]],
                                 {**nccl, "NCCL_HOSTID": f"reshard-bench-{h.name}"} if a.gpu else None)
                     for me, h in ((TRAINER, hosts.a), (ENGINE, hosts.b))]
            codes = [p.wait(3000) for p in procs]
        if any(codes):
            print(f"workers exited with {codes}", file=sys.stderr)
            return 1
    else:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=worker, args=(me, store.port, args, outs[me])) for me in (TRAINER, ENGINE)]
        for pr in procs:
            pr.start()
        for pr in procs:
            pr.join()
        if any(pr.exitcode != 0 for pr in procs):
            print(f"workers exited with {[pr.exitcode for pr in procs]}", file=sys.stderr)
            return 1
    res = [json.loads(Path(o).read_text()) for o in outs]
    trainer, engine = res
    slowest = lambda k: [max(x["seconds"], y["seconds"]) for x, y in zip(trainer[k], engine[k])  # noqa: E731
                         if "seconds" in x]
    dense_t = statistics.median(slowest("dense"))
    dense_b = trainer["dense"][0]["sent"]
    raw_t, raw_b = statistics.median(slowest("raw")), trainer["raw"][0]["sent"]
    where = f"two hosts (network namespaces), link limited to {a.link} by tc" if a.link else "loopback"
    mps = " under MPS" if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") else ""
    what = f"both on one GPU{mps}, NCCL" if a.gpu else "gloo"
    print(f"{trainer['params'] / 1e6:.1f}M bf16 parameters, Megatron TP1 -> vLLM TP1, two processes, {what} over "
          f"{where}; median of {a.iters}, slowest process")
    print(f"link ceiling: {raw_b:,} bytes in one send over the same group, {raw_t:.3f} s = "
          f"{raw_b / raw_t * 8 / 1e9:.2f} Gbit/s; the dense refit below moves {dense_b / dense_t * 8 / 1e9:.2f} Gbit/s")
    print(f"{'case':<12} {'sent':>12} {'of dense':>9} {'time s':>8} {'speed-up':>8}  ops dense/sparse/bitmap/unch  "
          f"equal")
    print(f"{'dense':<12} {dense_b:>12,} {1:>9.1%} {dense_t:>8.3f} {1:>8.2f}")
    table = {"raw": {"sent": raw_b, "seconds": raw_t}, "dense": {"sent": dense_b, "seconds": dense_t}}
    for p in a.fractions:
        k = f"delta {p:g}"
        rows = trainer[k][:-1]
        t = statistics.median(slowest(k))
        sent = statistics.median(r["sent"] for r in rows)
        ops = rows[-1]["ops"]
        equal = engine[k][-1].get("equal_to_dense")
        print(f"{p:<12.2%} {int(sent):>12,} {sent / dense_b:>9.2%} {t:>8.3f} {dense_t / t:>8.2f}  "
              f"{ops.get('dense', 0)}/{ops.get('sparse', 0)}/{ops.get('bitmap', 0)}/{ops.get('unchanged', 0)}"
              f"{'':>14} {equal}")
        table[k] = {"sent": sent, "of_dense": sent / dense_b, "seconds": t, "speedup": dense_t / t, "ops": ops,
                    "equal_to_dense": equal,
                    "phases_trainer": trainer[k][0]["phases"], "phases_engine": engine[k][0]["phases"]}
    if a.json:
        Path(a.json).write_text(json.dumps({"table": table, "raw": res, "args": vars(a)}, indent=1))
    return 0


# --- GPU: a delta refit's GPU work, one process -------------------------------------------------
def run_gpu(a) -> int:
    """--gpu: one process on one GPU holds the trainer's TP1 shard and the engine's TP1 tensors (a colocated plan,
    no group: every payload is local), so the refit's GPU work is measured alone: the sender's scan and encoding,
    the receiver's proof and the apply kernel. With the payload's trip through the host measured beside it, the
    refit over a link of --rate Gbit/s is predicted as that work plus the bytes at the link's rate, against the
    dense bytes at the same rate (which credits the dense refit with no work of its own)."""
    import reshard
    from reshard.executors import allocate, shard
    from reshard.executors.binding import Binding
    from reshard.executors.collective.executor import CollectiveExecutor
    from reshard.executors.delta import DeltaPolicy

    dev = torch.device("cuda")
    spec = _spec(vars(a))
    plan = reshard.compile(reshard.MegatronLayout(model=spec), reshard.VllmLayout(model=spec), colocated=True)
    binding = Binding((0,), (0,))
    g = torch.Generator(device=dev).manual_seed(0)
    src = {r: {n: (torch.randn(t.shape, generator=g, device=dev) * 0.02).to(torch.bfloat16) for n, t in ts.items()}
           for r, ts in allocate(plan.src, device="meta").items()}
    dst = allocate(plan.dst, device=dev)
    dense = CollectiveExecutor(plan, binding, 0, src, dst)
    # keyframes in place: no staging beside the sender's copy (a 78 GiB GPU holds an 8B model four times)
    delta = CollectiveExecutor(plan, binding, 0, src, dst, in_place=True, delta=DeltaPolicy(keyframe_every=1 << 30))

    def timed(run) -> tuple[float, object]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        stats = run()
        torch.cuda.synchronize()
        return time.perf_counter() - t0, stats

    def change(p: float) -> None:  # one ulp at a fraction p of the elements, on the GPU, outside the timing
        for ts in src.values():
            for t in ts.values():
                bits = t.view(-1).view(torch.int16)
                bits[torch.rand(bits.numel(), generator=g, device=dev) < p] ^= 1

    def host_trip(n: int) -> float:  # the payload to pinned host memory and back (a wire between hosts needs both)
        buf, host = torch.empty(n, dtype=torch.uint8, device=dev), torch.empty(n, dtype=torch.uint8).pin_memory()
        return statistics.median(timed(lambda: (host.copy_(buf), buf.copy_(host)))[0] for _ in range(5))

    rate = a.rate * 1e9 / 8  # bytes a second
    dense.refit()
    dense_t = statistics.median(timed(dense.refit)[0] for _ in range(a.iters))
    dense_b = plan.accounting.total_bytes
    dense.release()  # its staging (a model's worth): the delta path keeps the sender's copy instead
    delta.refit()  # the keyframe
    delta.release()
    print(f"{torch.cuda.get_device_name()}: {sum(t.numel for t in spec.tensors) / 1e9:.2f}B bf16 parameters, "
          f"one process (TP1 -> TP1, colocated); dense refit (a device copy) {dense_t * 1e3:.1f} ms; dense bytes "
          f"{dense_b / 1e9:.2f} GB = {dense_b / rate * 1e3:.0f} ms at {a.rate:g} Gbit/s")
    print(f"{'changed':>8} {'wire':>9} {'of dense':>8} {'GPU work ms':>11} {'encode':>7} {'verify':>7} "
          f"{'apply':>7} {'host trip':>9} {'at link ms':>10} {'speed-up':>8}  equal")
    table = {"device": torch.cuda.get_device_name(), "params": sum(t.numel for t in spec.tensors),
             "dense_bytes": dense_b, "dense_s": dense_t, "rate_gbit": a.rate, "rows": {}}
    for p in a.fractions:
        runs = []
        for _ in range(a.iters):
            change(p)
            runs.append(timed(delta.refit) + (delta.last_delta,))
        seconds = statistics.median(r[0] for r in runs)
        stats, rep = runs[-1][1], runs[-1][2]
        phases = {k: statistics.median(r[1].phases.get(k, 0.0) for r in runs) for k in ("encode", "verify", "apply")}
        trip = host_trip(rep.wire_bytes)
        at_link = seconds + trip + rep.wire_bytes / rate
        want = allocate(plan.dst, device=dev)  # byte for byte against a dense refit of the same source
        CollectiveExecutor(plan, binding, 0, src, want, in_place=True).refit()
        equal = all(torch.equal(dst[r][n].view(torch.int16), want[r][n].view(torch.int16)) for r in dst for n in dst[r])
        del want
        speedup = dense_b / rate / at_link
        print(f"{p:>8.2%} {rep.wire_bytes / 1e6:>7.1f}MB {rep.wire_bytes / dense_b:>8.2%} {seconds * 1e3:>11.1f} "
              f"{phases['encode'] * 1e3:>7.1f} {phases['verify'] * 1e3:>7.1f} {phases['apply'] * 1e3:>7.1f} "
              f"{trip * 1e3:>9.2f} {at_link * 1e3:>10.1f} {speedup:>8.2f}  {equal}")
        table["rows"][f"{p:g}"] = {"wire": rep.wire_bytes, "of_dense": rep.wire_bytes / dense_b, "seconds": seconds,
                                   "phases": phases, "host_trip_s": trip, "at_link_s": at_link, "speedup": speedup,
                                   "ops": rep.ops, "equal_to_dense": equal}
    if a.json:
        Path(a.json).write_text(json.dumps(table, indent=1))
    return 0


# --- GPU: the apply kernel alone -----------------------------------------------------------------
def _kernel_module():
    path = ROOT / "reshard" / "kernels" / "delta_apply.py"
    spec = importlib.util.spec_from_file_location("delta_apply", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_apply(a) -> int:
    import numpy as np

    k = _kernel_module()
    dev = torch.device("cuda")
    n, cols = a.numel, a.cols
    dst = torch.zeros(n, dtype=torch.bfloat16, device=dev)
    src = torch.randn(n, dtype=torch.bfloat16, device=dev)

    def timed(fn) -> float:
        fn()
        out = []
        for _ in range(a.iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            out.append(s.elapsed_time(e) / 1e3)
        return statistics.median(out)

    copy_t = timed(lambda: dst.copy_(src))
    print(f"{torch.cuda.get_device_name()}: bf16 destination of {n:,} elements ({n * 2 / 2**30:.2f} GiB); "
          f"dense in-place copy {copy_t * 1e3:.3f} ms ({2 * n * 2 / copy_t / 1e9:.0f} GB/s read+write)")
    print(f"{'changed':>8} {'kernel ms':>10} {'of copy':>8} {'index_put ms':>12}  equal")
    rows = {}
    g = np.random.default_rng(0)
    words = dst.view(torch.int16)
    for p in a.fractions:
        c = int(p * n)
        idx = np.sort(g.choice(n, size=c, replace=False)) if c < n // 100 else np.flatnonzero(g.random(n) < p)
        c = len(idx)
        index = torch.from_numpy(idx.astype(np.int32)).to(dev)  # box-local, as a payload carries them
        values = torch.randint(-30000, 30000, (c,), dtype=torch.int16, device=dev)
        rows_n = n // cols
        kt = timed(lambda: k.scatter([words], np.asarray([0]), np.asarray([c]), np.asarray([cols]),
                                     np.asarray([cols]), index, values))
        got = words.clone()
        pos = torch.from_numpy(idx.astype(np.int64)).to(dev)
        it = timed(lambda: words.index_put_((pos,), values))
        equal = torch.equal(got, words)
        print(f"{p:>8.2%} {kt * 1e3:>10.3f} {kt / copy_t:>8.1%} {it * 1e3:>12.3f}  {equal}")
        rows[f"{p:g}"] = {"changed": c, "kernel_s": kt, "of_copy": kt / copy_t, "index_put_s": it, "equal": equal,
                          "rows": rows_n}
    if a.json:
        Path(a.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "numel": n, "copy_s": copy_t,
                                            "rows": rows, "torch": torch.__version__}, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--apply", action="store_true", help="the GPU apply kernel alone (torch, numpy, Triton only)")
    ap.add_argument("--gpu", action="store_true", help="a delta refit's GPU work in one process, and the refit "
                    "over a link of --rate predicted from it; with --link, the refit over that link, measured: two "
                    "processes on one GPU, NCCL across the test bed's hosts")
    ap.add_argument("--rate", type=float, default=10.0, help="--gpu: the link's rate, Gbit/s")
    ap.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS))
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--config", default=None, help="an HF config (default: a synthetic Qwen3 of --hidden etc.)")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--numel", type=int, default=1 << 28, help="--apply: destination elements")
    ap.add_argument("--cols", type=int, default=4096, help="--apply: row width of the destination block")
    ap.add_argument("--link", default=None, help="a tc rate (e.g. 10gbit): trainer and engine on the test bed's two "
                    "hosts (tests/testbed/two_hosts.py: network namespaces; root)")
    ap.add_argument("--burst", default="1mbit", help="--link: the tc token bucket's burst (a fast link needs more)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--store", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--args", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker is not None:  # one process of a --link run, started on its host
        host, port = a.store.rsplit(":", 1)
        worker(a.worker, int(port), json.loads(a.args), a.out, host)
        return 0
    if a.apply:
        return run_apply(a)
    return run_gpu(a) if a.gpu and not a.link else run_pair(a)


if __name__ == "__main__":
    sys.exit(main())
