"""Refit benchmark over torch.distributed: the distributed executor against the link and against the common
packed gather-then-broadcast refit, on random bf16 weights of Qwen3-8B shape (16.4 GB).

    python benchmarks/refit_nccl.py            # two GPUs, NCCL (export NCCL_NVLS_ENABLE=0 first)
    python benchmarks/refit_nccl.py --small    # two CPU processes, gloo, a small model: a dry run

Cases (process 0 = GPU0, process 1 = GPU1):
  E1  Megatron TP1 on GPU0 -> vLLM TP1 on GPU1              (the whole model crosses)
  E2  Megatron TP2 on GPU0+GPU1 -> vLLM TP1 on GPU1         (half crosses, half is local)
  E3  Megatron TP2 on GPU0+GPU1 -> a vLLM TP1 replica on each GPU (half crosses each way)
  E4  one GPU, one process holding both: Megatron TP1 -> vLLM TP1 (all local)

Per case, measured in the same run: the executor end to end (staged, the default, and in place), the ceiling
(NCCL send/recv of exactly the bytes that cross, in one batch, both directions at once where both cross; a
device-to-device copy of the same bytes for E4), and a packed gather-then-broadcast refit written here: all-gather
every trainer parameter across its TP group, convert to HF tensors, pack them into 1 GiB buckets, broadcast each
bucket from trainer rank 0, unpack into the vLLM layout. Every executor run is checked byte for byte against the
gather-then-broadcast result. Times are medians over --iters runs, each the slowest process's time.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reshard  # noqa: E402
from reshard.executors.binding import Binding  # noqa: E402
from reshard.executors.collective.executor import CollectiveExecutor  # noqa: E402
from reshard.executors.reference import _box, torch_dtype  # noqa: E402

GiB = 1 << 30


def small_spec() -> reshard.ModelSpec:
    return reshard.ModelSpec(family="qwen3", hidden_size=512, num_layers=4, num_attention_heads=8,
                             num_key_value_heads=4, head_dim=64, intermediate_size=1536, vocab_size=8192,
                             qk_norm=True, dtype="bfloat16")


def cases(spec: reshard.ModelSpec) -> dict[str, tuple]:
    """name -> (plan, binding, processes taking part)."""
    M, V = reshard.MegatronLayout, reshard.VllmLayout
    return {
        "E1": (reshard.compile(M(model=spec), V(model=spec)), Binding((0,), (1,)), (0, 1)),
        "E2": (reshard.compile(M(model=spec, tp=2), V(model=spec)), Binding((0, 1), (1,)), (0, 1)),
        "E3": (reshard.compile(M(model=spec, tp=2), V(model=spec, replicas=2), colocated=True),
               Binding((0, 1), (0, 1)), (0, 1)),
        "E4": (reshard.compile(M(model=spec), V(model=spec), colocated=True), Binding((0,), (0,)), (0,)),
    }


# --- timing ----------------------------------------------------------------------------------------------
class Clock:
    def __init__(self, device: torch.device, group) -> None:
        self.device, self.group = device, group

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time(self, fn, iters: int, warmup: int = 1) -> list[float]:
        """Seconds per call, the slowest process of the group each time."""
        out = []
        for i in range(warmup + iters):
            self.sync()
            if self.group is not None:
                dist.barrier(group=self.group)
            t0 = time.perf_counter()
            fn()
            self.sync()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=self.device)
            if self.group is not None:
                dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=self.group)
            if i >= warmup:
                out.append(float(dt.item()))
        return out


# --- the common pattern: gather, convert to HF, pack 1 GiB buckets, broadcast, unpack -------------------
class GatherBroadcast:
    def __init__(self, plan, binding: Binding, me: int, src: dict, dst: dict, group, device,
                 bucket_bytes: int = GiB) -> None:
        self.src_layout, self.dst_layout = plan.src, plan.dst
        self.binding, self.me, self.src, self.dst, self.group, self.device = binding, me, src, dst, group, device
        self.dtype = torch_dtype(plan.dst.dtype)
        model = plan.src.model
        self.src_procs = sorted(set(binding.src))
        self.gatherer = binding.src[0]
        self.buckets: list[list] = []
        cur, size = [], 0
        for t in model.tensors:
            n = t.numel * model.itemsize
            if cur and size + n > bucket_bytes:
                self.buckets.append(cur)
                cur, size = [], 0
            cur.append(t)
            size += n
        if cur:
            self.buckets.append(cur)
        # placements, read once (the layouts are pure; this is not part of a refit)
        self.src_places = {t.name: plan.src.placements(t) for t in model.tensors}
        self.dst_places = {t.name: [p for p in plan.dst.placements(t) if binding.dst[p.rank] == me]
                           for t in model.tensors}
        self.receivers = sorted({binding.dst[p.rank] for ps in (plan.dst.placements(t) for t in model.tensors)
                                 for p in ps})
        self.max_bucket = max(sum(t.numel for t in b) for b in self.buckets)
        self.buf = torch.empty(self.max_bucket, dtype=self.dtype, device=device)

    def _gather(self, name: str) -> dict[int, torch.Tensor]:
        """All-gather one trainer parameter across the trainer processes: source rank -> its shard."""
        mine = {s: self.src[s][name] for s in self.binding.src_ranks_of(self.me) if name in self.src[s]}
        if len(self.src_procs) == 1:
            return mine
        local = next(iter(mine.values()))
        out = [torch.empty_like(local) for _ in self.src_procs]
        dist.all_gather(out, local, group=self.group)
        return {s: out[self.src_procs.index(p)] for s, p in enumerate(self.binding.src)}

    def __call__(self) -> None:
        me = self.me
        with torch.no_grad():
            for bucket in self.buckets:
                numel = sum(t.numel for t in bucket)
                buf = self.buf[:numel]
                gathered: dict[str, dict[int, torch.Tensor]] = {}
                if me in self.src_procs:
                    for t in bucket:
                        for p in self.src_places[t.name]:
                            if p.tensor not in gathered and 0 not in p.lengths:
                                gathered[p.tensor] = self._gather(p.tensor)
                off = 0
                views = []
                for t in bucket:
                    views.append(buf[off:off + t.numel].view(t.shape))
                    off += t.numel
                if me == self.gatherer:  # convert to HF straight into the bucket
                    for t, v in zip(bucket, views):
                        for p in self.src_places[t.name]:
                            if 0 in p.lengths:
                                continue
                            box = tuple(slice(o, o + n) for o, n in zip(p.canon_offset, p.lengths))
                            v[box].copy_(_box(gathered[p.tensor][p.rank], p.phys_offset, p.lengths))
                if len(set(self.receivers) | {self.gatherer}) > 1:
                    dist.broadcast(buf, src=self.gatherer, group=self.group)
                for t, v in zip(bucket, views):  # unpack into the vLLM layout
                    for p in self.dst_places[t.name]:
                        if 0 in p.lengths:
                            continue
                        box = tuple(slice(o, o + n) for o, n in zip(p.canon_offset, p.lengths))
                        _box(self.dst[p.rank][p.tensor], p.phys_offset, p.lengths).copy_(v[box])


# --- one case ----------------------------------------------------------------------------------------------
def zeros(layout, ranks, device) -> dict:
    dtype = torch_dtype(layout.dtype)
    return {r: {n: torch.zeros(shape, dtype=dtype, device=device) for n, shape in layout.rank_tensors(r).items()}
            for r in ranks}


def source_tensors(layout, ranks, device) -> dict:
    """Random weights (the same on every process: seeded per canonical tensor) laid out for `ranks`, so that
    replicated tensors agree across ranks as they do in a trainer."""
    out = zeros(layout, ranks, device)
    dtype = torch_dtype(layout.dtype)
    g = torch.Generator(device=device)
    with torch.no_grad():
        for t in layout.model.tensors:
            g.manual_seed(1000 + t.index)
            w = torch.empty(t.shape, dtype=torch.float32, device=device).normal_(generator=g).to(dtype)
            for p in layout.placements(t):
                if p.rank in out and 0 not in p.lengths:
                    box = tuple(slice(o, o + n) for o, n in zip(p.canon_offset, p.lengths))
                    _box(out[p.rank][p.tensor], p.phys_offset, p.lengths).copy_(w[box])
    return out


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[r][n].view(torch.int16), b[r][n].view(torch.int16)) for r in a for n in a[r])


def slowest(values: dict[str, float], group, device) -> dict[str, float]:
    """Each value's maximum over the processes of the group."""
    t = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(values, t.tolist()))


def ceiling(ex: CollectiveExecutor, me: int, clock: Clock, iters: int, device, itemsize: int) -> tuple[list, str]:
    s = ex.schedule
    if ex.size == 1:  # E4: a device-to-device copy of the bytes the plan copies
        n = s.part.local_numel
        a = torch.empty(n, dtype=torch.bfloat16, device=device).fill_(1)
        b = torch.empty_like(a)
        times = clock.time(lambda: b.copy_(a), iters)
        del a, b
        return times, "d2d copy"
    sends = {p: torch.ones(s.part.numel(ops), dtype=torch.bfloat16, device=device)
             for p, ops in s.part.sends_to.items()}
    recvs = {p: torch.empty(s.part.numel(ops), dtype=torch.bfloat16, device=device)
             for p, ops in s.part.receives_from.items()}
    chunk = (2 * GiB) // itemsize  # NCCL's bandwidth has flattened out well before 2 GiB messages
    comm = ex.comm  # the executor's group: raw messages over the same communicator

    def move():
        batch = comm.prepare(0, [(t[i:i + chunk], p, 0) for p, t in sends.items() for i in range(0, t.numel(), chunk)],
                             [(t[i:i + chunk], p, 0) for p, t in recvs.items() for i in range(0, t.numel(), chunk)])
        for w in comm.post(batch):
            w.wait()

    times = clock.time(move, iters)
    del sends, recvs
    both = torch.tensor([int(bool(s.part.sends_to) and bool(s.part.receives_from))], device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=clock.group)
    return times, "send/recv both ways" if int(both.item()) else "send/recv one way"


def run_case(name: str, plan, binding: Binding, procs, me: int, groups: dict, device, args) -> dict | None:
    if me not in procs:
        return None
    ex_group = groups[len(procs)]  # the world, or a group of process 0 alone
    group = ex_group if len(procs) > 1 else None  # for timing and agreement
    clock = Clock(device, group)
    my_src, my_dst = binding.src_ranks_of(me), binding.dst_ranks_of(me)
    src = source_tensors(plan.src, my_src, device)
    out: dict = {"case": name}
    options = {"memory_cap": args.memory_cap, "bucket_bytes": args.bucket_bytes, "timeout": 120.0,
               "direct_bytes": "auto" if args.direct_bytes is None else (args.direct_bytes or None),
               "lanes": args.lanes}

    staged = CollectiveExecutor(plan, binding, None, src, None, group=ex_group, **options)
    s = staged.schedule
    itemsize = plan.itemsize
    crossing = torch.tensor([sum(s.part.bytes_sent.values()), sum(s.part.bytes_received.values())],
                            dtype=torch.float64, device=device)
    if group is not None:
        dist.all_reduce(crossing, group=group)
    out["cross_bytes_sent"] = int(crossing[0].item())
    out["local_bytes"] = s.part.local_numel * itemsize
    out["bucket_bytes"] = s.bucket_numel * itemsize
    out["rounds"] = len(s.rounds)

    t, kind = ceiling(staged, me, clock, args.iters, device, itemsize)
    out["ceiling_s"], out["ceiling_kind"] = statistics.median(t), kind
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # reference result: the gather-then-broadcast refit
    want = zeros(plan.dst, my_dst, device)
    gb = GatherBroadcast(plan, binding, me, src, want, group, device)
    t = clock.time(gb, max(args.iters // 2, 2))
    out["gather_broadcast_s"] = statistics.median(t)
    del gb

    got = zeros(plan.dst, my_dst, device)
    last: dict = {}
    t = clock.time(lambda: last.update(stats=staged.refit(dst=got)), args.iters)
    out["staged_s"], out["staged_runs"] = statistics.median(t), t
    out["staged_ok"] = same(got, want)
    out["staged_phases"] = slowest(last["stats"].phases, group, device)
    out["staging_bytes"] = slowest({"b": float(last["stats"].staging_bytes)}, group, device)["b"]
    out["copies"] = last["stats"].copies
    out["lanes"] = last["stats"].lanes
    del staged
    if device.type == "cuda":
        torch.cuda.empty_cache()

    for mode in ("in_place", "undo"):  # the other two ways a refit can treat its destinations
        for tensors in got.values():
            for x in tensors.values():
                x.zero_()
        ex = CollectiveExecutor(plan, binding, None, src, got, group=ex_group, **{mode: True}, **options)
        t = clock.time(lambda: last.update(stats=ex.refit()), args.iters)
        out[f"{mode}_s"], out[f"{mode}_runs"] = statistics.median(t), t
        out[f"{mode}_ok"] = same(got, want)
        out[f"{mode}_phases"] = slowest(last["stats"].phases, group, device)
        del ex
    ok = torch.tensor([int(out["staged_ok"] and out["in_place_ok"] and out["undo_ok"])], device=device)
    if group is not None:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    out["all_ok"] = bool(ok.item())
    del src, got, want
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


# --- transport checks: small plans with fan-out relays and odd buckets, against the local executor ---------
def check_plans() -> list[tuple]:
    spec = reshard.ModelSpec(family="qwen3", hidden_size=64, num_layers=2, num_attention_heads=8,
                             num_key_value_heads=4, head_dim=8, intermediate_size=96, vocab_size=300, qk_norm=True,
                             dtype="bfloat16")
    moe = reshard.ModelSpec(family="qwen3_moe", hidden_size=32, num_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, intermediate_size=0, vocab_size=200, qk_norm=True,
                            num_experts=4, moe_intermediate_size=16, dtype="bfloat16")
    M, V, H = reshard.MegatronLayout, reshard.VllmLayout, reshard.HfLayout
    return [
        (reshard.compile(M(model=spec, tp=2), V(model=spec, replicas=3), fanout=1), Binding((0, 1), (1, 0, 1))),
        (reshard.compile(M(model=spec, tp=2, pp=2), V(model=spec, tp=2, replicas=2), colocated=True, fanout=1),
         Binding((0, 1, 0, 1), (0, 1, 1, 0))),
        (reshard.compile(V(model=spec, tp=4), M(model=spec, tp=2)), Binding((0, 1, 1, 0), (1, 0))),
        (reshard.compile(M(model=moe, tp=2, ep=2, etp=1), V(model=moe, tp=2, expert_parallel=True, replicas=2),
                         fanout=1), Binding((0, 1), (1, 0, 0, 1))),
        (reshard.compile(H(model=spec), V(model=spec, tp=2, replicas=2), fanout=2), Binding((0,), (1, 1, 0, 0))),
    ]


def run_checks(me: int, device) -> list[str]:
    from reshard.executors import allocate, execute_local, shard

    failures = []
    for i, (plan, binding) in enumerate(check_plans()):
        g = torch.Generator().manual_seed(i)
        w = {t.name: torch.randn(t.shape, generator=g).to(torch.bfloat16) for t in plan.src.model.tensors}
        src_all = shard(plan.src, w)
        want = allocate(plan.dst, fill=-3.0)
        execute_local(plan, src_all, want)
        for mode in ({}, {"in_place": True}, {"undo": True}):
            for bucket in (4096, 1 << 20):
                src = {r: {n: t.to(device) for n, t in src_all[r].items()} for r in binding.src_ranks_of(me)}
                got = {r: {n: torch.full_like(t, -3.0, device=device) for n, t in want[r].items()}
                       for r in binding.dst_ranks_of(me)}
                ex = CollectiveExecutor(plan, binding, None, src, got, bucket_bytes=bucket, timeout=60.0, direct_bytes=256,
                                         **mode)
                for _ in range(2):
                    ex.refit()
                for r, ts in got.items():
                    for n, t in ts.items():
                        if not torch.equal(t.cpu().view(torch.int16), want[r][n].view(torch.int16)):
                            failures.append(f"check {i} {mode or 'staged'} bucket={bucket}: rank {r} {n}")
    return failures


# --- processes ---------------------------------------------------------------------------------------------
def worker(args) -> None:
    rank = args.worker
    small = args.small
    if small:
        device = torch.device("cpu")
        backend = "gloo"
    else:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        backend = "nccl"
    kw = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=f"file://{args.store}", rank=rank, world_size=args.world,
                            timeout=timedelta(seconds=300), **kw)
    spec = small_spec() if small else reshard.ModelSpec.from_hf_config(ROOT / "examples/configs/qwen3-8b.json")
    groups = {2: dist.group.WORLD, 1: dist.new_group([0])} if args.world == 2 else {1: dist.group.WORLD}
    if args.check and args.world == 2:
        failures = run_checks(rank, device)
        print(f"rank {rank}: transport checks {'passed' if not failures else 'FAILED'} {failures[:5]}", flush=True)
    results = []
    for name, (plan, binding, procs) in cases(spec).items():
        if name not in args.cases.split(","):
            continue
        dist.barrier()
        r = run_case(name, plan, binding, procs, rank, groups, device, args)
        if r is not None:
            r["model_bytes"] = plan.accounting.model_bytes
            results.append(r)
        dist.barrier()
    if rank == 0:
        Path(args.out).write_text(json.dumps(results, indent=1))
    sys.stdout.flush()
    os._exit(0)


def table(results: list[dict], device: str) -> str:
    lines = [f"refit benchmark on {device}",
             "case | crossing GB | bucket MiB | executor staged ms | executor in-place ms | executor undo ms | "
             "ceiling ms (kind) | % of ceiling staged / in-place / undo | gather-broadcast ms | correct"]
    for r in results:
        c = r["ceiling_s"]
        lines.append(
            f"{r['case']} | {r['cross_bytes_sent'] / 1e9:.2f} | {r['bucket_bytes'] / 2**20:.0f} | "
            f"{r['staged_s'] * 1e3:.1f} | {r['in_place_s'] * 1e3:.1f} | {r['undo_s'] * 1e3:.1f} | "
            f"{c * 1e3:.1f} ({r['ceiling_kind']}) | "
            f"{100 * c / r['staged_s']:.0f}% / {100 * c / r['in_place_s']:.0f}% / {100 * c / r['undo_s']:.0f}% | "
            f"{r['gather_broadcast_s'] * 1e3:.1f} | {'yes' if r['all_ok'] else 'NO'}")
    lines.append("phases of the last run, slowest process (ms): staged | in place | undo")
    for r in results:
        fmt = lambda ph: " ".join(f"{k}={v * 1e3:.1f}" for k, v in ph.items())  # noqa: E731
        lines.append(f"{r['case']}: {fmt(r['staged_phases'])} | {fmt(r['in_place_phases'])} | "
                     f"{fmt(r['undo_phases'])}  "
                     f"(copies {r['copies']}, rounds {r['rounds']}, lanes {r.get('lanes', 1)}, staging {r['staging_bytes'] / 1e9:.1f} GB)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="CPU + gloo with a small model (a dry run)")
    ap.add_argument("--cases", default="E1,E2,E3,E4")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--memory-cap", type=int, default=4 * GiB, help="wire buffer cap per process (bytes)")
    ap.add_argument("--bucket-bytes", type=int, default=GiB, help="largest wire message (bytes)")
    ap.add_argument("--direct-bytes", type=int, default=None,
                    help="shortest run sent from / received into the tensors unpacked (bytes; 0: only whole "
                         "messages; default: the executor's, which depends on --lanes)")
    ap.add_argument("--lanes", type=int, default=None,
                    help="communicators the rounds are spread over (default: the executor's, 3 on NCCL)")
    ap.add_argument("--check", action="store_true", help="first check small plans with relays against execute_local")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--store", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args)
        return
    # cases of one process (E4) need one GPU: run them alone, in one process, where two GPUs are not there
    wanted = [c for c in args.cases.split(",") if c]
    single = {"E4"}
    if not args.small and torch.cuda.device_count() < 2:
        skipped = [c for c in wanted if c not in single]
        if skipped:
            print(f"one GPU here: skipping {skipped} (they need two); running {[c for c in wanted if c in single]}")
        wanted = [c for c in wanted if c in single]
        if not wanted:
            sys.exit("no case of the ones asked for runs on one GPU")
    world = 1 if all(c in single for c in wanted) else 2
    args.cases = ",".join(wanted)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or str(Path(tmp) / "results.json")
        store = str(Path(tmp) / "store")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--store", store, "--out", out, "--cases", args.cases,
               "--iters", str(args.iters), "--memory-cap", str(args.memory_cap),
               "--bucket-bytes", str(args.bucket_bytes), "--world", str(world)] + \
            (["--lanes", str(args.lanes)] if args.lanes is not None else []) + \
            (["--direct-bytes", str(args.direct_bytes)] if args.direct_bytes is not None else []) + \
            (["--small"] if args.small else []) + \
            (["--check"] if args.check else [])
        procs = [subprocess.Popen(cmd + ["--worker", str(r)]) for r in range(world)]
        codes = [p.wait() for p in procs]
        if any(codes) or not Path(out).exists():
            sys.exit(f"a worker failed (exit codes {codes})")
        results = json.loads(Path(out).read_text())
    device = "CPU (gloo)" if args.small else torch.cuda.get_device_name(0) + f" x{world} (NCCL)"
    print(table(results, device))
    if not args.small:
        print(predictions(results))


def predictions(results: list[dict]) -> str:
    """The bandwidth model's prediction (reshard.planner.cost) beside each measurement of this run."""
    from reshard.planner import compare_with_measurement
    from reshard.planner.cost import ClusterModel

    plans = cases(reshard.ModelSpec.from_hf_config(ROOT / "examples/configs/qwen3-8b.json"))
    lines = ["prediction beside measurement (bandwidth model, figures measured on this machine type):"]
    for r in results:
        plan, binding, _ = plans[r["case"]]
        where = ClusterModel(src_gpus=binding.src, dst_gpus=binding.dst)
        lines.append(f"{r['case']} in place: " + compare_with_measurement(plan, r["in_place_s"], where))
        staged = dataclasses.replace(where, commit_copies=1.0, overlap_copies=False)
        lines.append(f"{r['case']} staged:   " + compare_with_measurement(plan, r["staged_s"], staged))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
