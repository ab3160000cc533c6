"""Cross-process refits on one host, each figure beside its ceiling measured in the same run.

Two processes: a trainer (Megatron TP1 source tensors of the model) and an engine (vLLM TP1 destination tensors),
the "E4" shape across a process boundary. Cases:
  shared staged / in place   executors.shared: the trainer copies into the engine's memory (CPU: POSIX shared
                             memory, in place into destinations allocated in it; GPU: CUDA IPC, one GPU)
  copy                       ceiling: one copy of the same bytes in one process (CPU memcpy; GPU device copy)
  ping-pong                  the packed pattern NeMo-RL's colocated refit uses: the trainer packs buckets into two
                             shared buffers in turn, the engine unpacks each (no layout change: its best case)
  collective (CPU)           the torch.distributed executor over a store-made gloo group, in place
  gloo send/recv (CPU)       ceiling of the above: the same bytes as raw gloo messages of one bucket each
  ...+sha256, ...+sum64      (--checksum) the same refit with the end-to-end checksum option, per algorithm,
                             beside the refit without it

    python benchmarks/refit_shared.py [--device cpu|cuda] [--config examples/configs/qwen3-0.6b.json] [--iters 5]

Prints a table (median of --iters, slowest process) and, with --json PATH, the raw numbers.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TRAINER, ENGINE = 0, 1


def _store(port: int):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False)


def _barrier(store, name: str, me: int) -> None:
    store.add(name, 1)
    while int(store.add(name, 0)) < 2:
        time.sleep(0.0002)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(store, name: str, me: int, device: torch.device, fn) -> float:
    _barrier(store, f"{name}/go", me)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _tensors(plan, me: int, device: torch.device, in_place: bool):
    from reshard.executors import allocate
    from reshard.executors.shared import shared_empty

    if me == TRAINER:
        src = allocate(plan.src, device=device)
        g = torch.Generator(device=device).manual_seed(0)
        for t in src[0].values():
            t.copy_(torch.randn(t.shape, generator=g, device=device, dtype=torch.float32).to(t.dtype))
        return src, {}
    dst = allocate(plan.dst, device=device)
    if in_place and device.type == "cpu":
        dst = {0: {n: shared_empty(tuple(t.shape), t.dtype) for n, t in dst[0].items()}}
    return {}, dst


def worker(me: int, port: int, args: dict, out: str) -> None:
    import torch.distributed as dist

    import reshard
    from reshard.executors.binding import Binding
    from reshard.executors.collective.comm import StoreComm
    from reshard.executors.collective.executor import CollectiveExecutor
    from reshard.executors.shared import SharedExecutor

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    device = torch.device(args["device"])
    if device.type == "cuda":
        torch.cuda.set_device(0)
    store = _store(port)
    spec = reshard.ModelSpec.from_hf_config(args["config"])
    plan = reshard.compile(reshard.MegatronLayout(model=spec), reshard.VllmLayout(model=spec))
    binding = Binding((TRAINER,), (ENGINE,))
    nbytes = plan.accounting.total_bytes
    results: dict = {"bytes": nbytes}
    iters = args["iters"]
    cases = [("shared staged", True, False), ("shared in place", False, False)]
    for name in args["checksum"]:  # the end-to-end checksum option's cost (executors.checksum), per algorithm
        cases.append((f"in place+{name}", False, name))
    for name, staged, checksum in cases:
        src, dst = _tensors(plan, me, device, not staged)
        ex = SharedExecutor(plan, binding, me, src, dst, store=store, staged=staged, namespace=name.replace(" ", "-"),
                            timeout=600, checksum=checksum)
        ex.refit()  # warm-up: first touches of every page
        phases: list = []
        results[name] = [_timed(store, f"{name}/{i}", me, device, lambda: phases.append(ex.refit().phases))
                         for i in range(iters)]
        results[f"{name} phases"] = {k: statistics.median(p[k] for p in phases) for k in phases[0]}
        ex.close()
        del src, dst
    # ceiling: one copy of the same bytes in one process
    if me == ENGINE:
        a = torch.empty(nbytes, dtype=torch.uint8, device=device)
        b = torch.empty_like(a)
        a.fill_(1), b.fill_(2)
        b.copy_(a)
        _sync(device)
        copies = []
        for _ in range(iters):
            t0 = time.perf_counter()
            b.copy_(a)
            _sync(device)
            copies.append(time.perf_counter() - t0)
        results["copy"] = copies
        del a, b
    results["ping-pong"] = _ping_pong(store, me, device, nbytes, args["bucket"], iters)
    if device.type == "cpu":
        comm = StoreComm(dist.PrefixStore("bench/", store), me, 2, "gloo", 600.0)
        src, dst = _tensors(plan, me, device, False)
        ex = CollectiveExecutor(plan, binding, me, src, dst, group=comm, in_place=True, timeout=600.0,
                                 bucket_bytes=args["bucket"], **({"direct_bytes": args["direct"]} if args.get("direct")
                                                                 else {}))
        ex.refit()
        results["collective"] = [_timed(store, f"coll/{i}", me, device, ex.refit) for i in range(iters)]
        ex.close()
        for name in args["checksum"]:
            ex = CollectiveExecutor(plan, binding, me, src, dst, group=comm, in_place=True, timeout=600.0,
                                     bucket_bytes=args["bucket"], checksum=name)
            ex.refit()
            results[f"collective+{name}"] = [_timed(store, f"coll{name}/{i}", me, device, ex.refit)
                                             for i in range(iters)]
            ex.close()
        del src, dst, ex
        results["gloo send/recv"] = _raw_gloo(comm, store, me, nbytes, args["bucket"], iters)
    Path(out).write_text(json.dumps(results))


def _ping_pong(store, me: int, device: torch.device, nbytes: int, bucket: int, iters: int) -> list[float]:
    """The trainer packs its bytes bucket by bucket into two buffers the engine shares (in turn), the engine
    unpacks each into its destination: two copies per byte, and a handshake per bucket."""
    from reshard.executors.exchange import Exchange
    from reshard.executors.shared import export, open_handle, shared_empty

    ex = Exchange(store, "pingpong", transport="bench")
    if me == ENGINE:
        bufs = [shared_empty((bucket,), torch.uint8) if device.type == "cpu"
                else torch.empty(bucket, dtype=torch.uint8, device=device) for _ in range(2)]
        ex.publish(me, b"", {"bufs": [export(b) for b in bufs]})
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    else:
        _, book = ex.fetch(ENGINE, 600)
        segments: dict = {}
        bufs = [open_handle(h, torch.uint8, device, segments) for h in book["bufs"]]
        flat = torch.ones(nbytes, dtype=torch.uint8, device=device)
    starts = list(range(0, nbytes, bucket))
    times = []
    for it in range(iters + 1):
        _barrier(store, f"pp/{it}/go", me)
        t0 = time.perf_counter()
        for k, s in enumerate(starts):
            n = min(bucket, nbytes - s)
            key = f"pp/{it}/{k}"
            if me == TRAINER:
                if k >= 2:
                    ex.wait_count(f"pp/{it}/{k - 2}/free", 1, 0, time.monotonic() + 600, 0.0002, "a free buffer")
                bufs[k % 2][:n].copy_(flat[s:s + n])
                _sync(device)
                ex.signal(f"{key}/full")
            else:
                ex.wait_count(f"{key}/full", 1, 0, time.monotonic() + 600, 0.0002, "a full buffer")
                flat[s:s + n].copy_(bufs[k % 2][:n])
                _sync(device)
                ex.signal(f"{key}/free")
        if it:
            times.append(time.perf_counter() - t0)
    return times


def _raw_gloo(comm, store, me: int, nbytes: int, bucket: int, iters: int) -> list[float]:
    flat = torch.ones(nbytes, dtype=torch.uint8)
    pg = comm.lanes[0]
    times = []
    for it in range(iters + 1):
        _barrier(store, f"raw/{it}/go", me)
        t0 = time.perf_counter()
        works = [(pg.send if me == TRAINER else pg.recv)([flat[s:s + bucket]], 1 - me, k)
                 for k, s in enumerate(range(0, nbytes, bucket))]
        for w in works:
            w.wait()
        if it:
            times.append(time.perf_counter() - t0)
    return times


def main() -> int:
    import torch.distributed as dist

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--config", default=None)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--bucket", type=int, default=None, help="bytes per message / ping-pong buffer")
    p.add_argument("--direct-bytes", type=int, default=None, help="the collective executor's direct_bytes")
    p.add_argument("--checksum", nargs="?", const="sha256,sum64", default="",
                   help="also measure the end-to-end checksum option with these algorithms (default: both)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    config = a.config or str(ROOT / ("examples/configs/qwen3-8b.json" if a.device == "cuda"
                                     else "examples/configs/qwen3-0.6b.json"))
    args = {"device": a.device, "config": config, "iters": a.iters, "direct": a.direct_bytes,
            "checksum": [c for c in a.checksum.split(",") if c],
            "bucket": a.bucket or ((1 << 30) if a.device == "cuda" else (64 << 20))}
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    outs = [f"/tmp/refit_shared_{os.getpid()}_{me}.json" for me in (TRAINER, ENGINE)]
    procs = [ctx.Process(target=worker, args=(me, store.port, args, outs[me])) for me in (TRAINER, ENGINE)]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join()
    if any(pr.exitcode != 0 for pr in procs):
        print(f"workers exited with {[pr.exitcode for pr in procs]}", file=sys.stderr)
        return 1
    res = [json.loads(Path(o).read_text()) for o in outs]
    nbytes = res[ENGINE]["bytes"]
    slowest = lambda k: [max(x, y) for x, y in zip(res[0][k], res[1][k])] if k in res[0] else res[1][k]  # noqa
    cases = [k for k in res[ENGINE] if k != "bytes" and not k.endswith("phases")]
    med = {k: statistics.median(slowest(k)) for k in cases}
    gib = nbytes / 2**30
    print(f"{Path(config).name} Megatron TP1 -> vLLM TP1 across two processes on {a.device}: {gib:.2f} GiB, "
          f"median of {a.iters}, slowest process")
    print(f"{'case':<18} {'time':>10} {'GiB/s':>8}  vs ceiling")
    ceilings = {"shared staged": "copy", "shared in place": "copy", "ping-pong": "copy",
                "collective": "gloo send/recv", **{f"in place+{c}": "shared in place" for c in ("sha256", "sum64")},
                **{f"collective+{c}": "collective" for c in ("sha256", "sum64")}}
    for k, t in med.items():
        ref = ceilings.get(k)
        rel = f"{med[ref] / t:6.0%} of {ref}" if ref in med else "(ceiling)"
        steps = "".join(f"; {who}: " + ", ".join(f"{p} {v * 1e3:.1f}" for p, v in res[i][f"{k} phases"].items())
                        for i, who in ((TRAINER, "trainer"), (ENGINE, "engine")) if f"{k} phases" in res[i])
        print(f"{k:<18} {t * 1e3:8.1f} ms {gib / t:8.2f}  {rel}{steps}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": args, "bytes": nbytes, "median_s": med,
                                            "phases": {who: {k: v for k, v in res[i].items() if k.endswith("phases")}
                                                       for i, who in ((TRAINER, "trainer"), (ENGINE, "engine"))},
                                            "runs": {k: slowest(k) for k in med}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
