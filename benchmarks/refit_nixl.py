"""Refit benchmark over NIXL: the NIXL executor against one raw NIXL transfer of the same bytes between the
same two processes, measured in the same run.

    python benchmarks/refit_nixl.py            # CPU: two processes, DRAM over UCX (cma), a ~330 MB bf16 model
    python benchmarks/refit_nixl.py --gpu      # two GPUs: case E1 at Qwen3-8B shape (16.4 GB), plus NCCL
                                               # send/recv of the same bytes (export NCCL_NVLS_ENABLE=0 first)

Process 0 holds the trainer (source) ranks, process 1 the vLLM (destination) ranks; on GPUs process i uses GPU i.
Cases:
  E1  Megatron TP1 -> vLLM TP1: the whole model crosses, in contiguous pieces
  E2  Megatron TP2 (both ranks on process 0) -> vLLM TP1: row-parallel weights arrive as strided blocks,
      where packing (gather, one descriptor, scatter) competes with one descriptor per row
Variants: READ (receiver pulls) or WRITE (sender pushes), staged (commit after agreement) or in place, packing
auto / never / always. Baselines, same bytes, same processes, same run: one raw NIXL READ and one raw WRITE of
a single contiguous buffer (posted by the initiator, completed when the target has the transfer's
notification); on GPUs also NCCL send/recv; on CPU a memcpy in one process. Each variant's refits alternate
with raw transfers of its direction, so both see the same load (the CPU machine is shared and noisy); times are
medians over --iters, each the slower process's time. Every variant's destination tensors are checked against
the source weights after its last refit.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reshard  # noqa: E402
from reshard.executors.binding import Binding  # noqa: E402
from reshard.executors.reference import _box, torch_dtype  # noqa: E402

GB = 1e9


def cpu_spec() -> reshard.ModelSpec:
    return reshard.ModelSpec(family="qwen3", hidden_size=1024, num_layers=8, num_attention_heads=16,
                             num_key_value_heads=8, head_dim=64, intermediate_size=3072, vocab_size=32000,
                             qk_norm=True, dtype="bfloat16")


def qwen3_8b() -> reshard.ModelSpec:
    return reshard.ModelSpec(family="qwen3", hidden_size=4096, num_layers=36, num_attention_heads=32,
                             num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                             qk_norm=True, dtype="bfloat16")


def row_spec(row_bytes: int, total_bytes: int) -> reshard.ModelSpec:
    """A model whose down_proj weights, split on columns by Megatron TP2, arrive as rows of `row_bytes`."""
    ffn = row_bytes  # bf16: a row of ffn/2 elements is ffn bytes
    hidden = max(16, total_bytes // (4 * ffn * 2) // 16 * 16)
    return reshard.ModelSpec(family="qwen3", hidden_size=hidden, num_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, intermediate_size=ffn, vocab_size=128,
                             qk_norm=True, dtype="bfloat16")


def cases(spec: reshard.ModelSpec, gpu: bool, sweep: bool) -> dict[str, tuple]:
    M, V = reshard.MegatronLayout, reshard.VllmLayout
    out = {"E1": (reshard.compile(M(model=spec), V(model=spec)), Binding((0,), (1,)))}
    if not gpu:
        out["E2"] = (reshard.compile(M(model=spec, tp=2), V(model=spec)), Binding((0, 0), (1,)))
    if sweep:  # packing against one descriptor per row, by row size: down_proj only
        # (on GPUs from 16 KiB: 4 KiB rows of 1 GiB are 262144 descriptors, a copy launch each)
        for row in (16 << 10, 64 << 10, 256 << 10, 1 << 20) if gpu else (4 << 10, 8 << 10, 16 << 10, 32 << 10, 64 << 10):
            rs = row_spec(row, (1 << 30) if gpu else (128 << 20))
            names = [t.name for t in rs.tensors if t.name.endswith("down_proj.weight")]
            out[f"rows-{row >> 10}KiB"] = (reshard.compile(M(model=rs, tp=2), V(model=rs), tensors=names),
                                          Binding((0, 0), (1,)))
    return out


def variants(case: str, gpu: bool) -> list[dict]:
    if case.startswith("rows-"):
        return [{"direction": "read", "staged": False, "pack": p} for p in ("never", "always")]
    base = [{"direction": d, "staged": s} for d in ("read", "write") for s in (True, False)]
    base += [{"direction": d, "staged": False, "land_below": 0} for d in ("read", "write")]  # landing off
    if case == "E2":
        base += [{"direction": "read", "staged": False, "pack": p} for p in ("never", "always")]
        base += [{"direction": "write", "staged": False, "pack": p} for p in ("never", "always")]
    return base


# --- weights: the same on every process, seeded per canonical tensor ----------------------------------------
def canonical(t: reshard.TensorSpec, device: torch.device, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device)
    g.manual_seed(seed * 100003 + t.index)
    return torch.empty(t.shape, dtype=torch.float32, device=device).normal_(generator=g).to(dtype)


def laid_out(layout, ranks, device, seed: int | None, fill: float = 0.0) -> dict:
    """Tensors of `ranks` holding the seeded weights (seed None: only `fill`)."""
    dtype = torch_dtype(layout.dtype)
    out = {r: {n: torch.full(s, fill, dtype=dtype, device=device) for n, s in layout.rank_tensors(r).items()}
           for r in ranks}
    if not out or seed is None:
        return out
    with torch.no_grad():
        for t in layout.model.tensors:
            w = canonical(t, device, dtype, seed)
            for p in layout.placements(t):
                if p.rank in out and 0 not in p.lengths:
                    box = tuple(slice(o, o + n) for o, n in zip(p.canon_offset, p.lengths))
                    _box(out[p.rank][p.tensor], p.phys_offset, p.lengths).copy_(w[box])
    return out


def matches(layout, tensors: dict, device, seed: int, names=None) -> bool:
    """Destination tensors hold the seeded weights (of canonical tensors `names`, default all), canonical tensor
    by canonical tensor (bounded memory)."""
    dtype = torch_dtype(layout.dtype)
    for t in layout.model.tensors:
        if names is not None and t.name not in names:
            continue
        w = canonical(t, device, dtype, seed)
        for p in layout.placements(t):
            if p.rank in tensors and 0 not in p.lengths:
                box = tuple(slice(o, o + n) for o, n in zip(p.canon_offset, p.lengths))
                got = _box(tensors[p.rank][p.tensor], p.phys_offset, p.lengths)
                if not torch.equal(got.view(torch.int16), w[box].view(torch.int16)):
                    return False
    return True


# --- timing --------------------------------------------------------------------------------------------------
class Clock:
    def __init__(self, device: torch.device, group) -> None:
        self.device, self.group = device, group  # a gloo group: barriers and host-side reductions

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def once(self, fn) -> float:
        """Seconds of one call, the slower process's."""
        self.sync()
        dist.barrier(group=self.group)
        t0 = time.perf_counter()
        fn()
        self.sync()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=self.group)
        return float(dt.item())

    def time(self, fn, iters: int, warmup: int = 1) -> list[float]:
        return [self.once(fn) for _ in range(warmup + iters)][warmup:]

    def paired(self, fn, baseline, iters: int, warmup: int = 1) -> tuple[list[float], list[float]]:
        """fn and baseline alternately (so both see the same machine load), seconds of each."""
        pairs = [(self.once(baseline), self.once(fn)) for _ in range(warmup + iters)][warmup:]
        return [p[1] for p in pairs], [p[0] for p in pairs]


# --- one raw NIXL transfer of the same bytes ---------------------------------------------------------------
class RawNixl:
    """One contiguous buffer per process, one descriptor, READ posted by process 1 or WRITE by process 0; done
    when the initiator sees DONE and the target has the transfer's notification."""

    def __init__(self, me: int, nbytes: int, device: torch.device, store, delay_us: int) -> None:
        import numpy as np

        from reshard.executors.nixl.agent import make_agent

        self.me, self.peer = me, 1 - me
        self.agent = make_agent(f"raw:{me}", delay_us)
        self.buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        mem = "VRAM" if device.type == "cuda" else "DRAM"
        dev = (device.index or 0) if device.type == "cuda" else 0
        region = np.array([[self.buf.data_ptr(), nbytes, dev]], dtype=np.uint64)
        self.reg = self.agent.register_memory(region, mem)
        store.set(f"raw/md/{me}", self.agent.get_agent_metadata())
        store.set(f"raw/addr/{me}", json.dumps([self.buf.data_ptr(), dev]).encode())
        store.wait([f"raw/md/{self.peer}"])
        self.peer_name = self.agent.add_remote_agent(store.get(f"raw/md/{self.peer}"))
        self.peer_name = self.peer_name.decode() if isinstance(self.peer_name, bytes) else self.peer_name
        peer_addr, peer_dev = json.loads(store.get(f"raw/addr/{self.peer}").decode())
        self.local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", region, mem)
        self.remote = self.agent.prep_xfer_dlist(
            self.peer_name, np.array([[peer_addr, nbytes, peer_dev]], dtype=np.uint64), mem)
        op = "READ" if me == 1 else "WRITE"
        self.handle = self.agent.make_prepped_xfer(op, self.local, [0], self.remote, [0])
        self.agent.make_connection(self.peer_name)
        self.count = 0

    def run(self, op: str) -> None:
        self.count += 1
        tag = f"raw{self.count}".encode()
        initiator = 1 if op == "READ" else 0
        sleep = 2e-5  # poll like the executor does: back off up to its poll_max_s
        if self.me == initiator:
            state = self.agent.transfer(self.handle, tag)
            while state != "DONE":
                time.sleep(sleep)
                sleep = min(2 * sleep, 5e-4)
                state = self.agent.check_xfer_state(self.handle)
        else:
            while not any(tag in msgs for msgs in self.agent.get_new_notifs().values()):
                time.sleep(sleep)
                sleep = min(2 * sleep, 5e-4)

    def close(self) -> None:
        for h in (self.handle, self.local, self.remote):
            h.release()
        self.agent.remove_remote_agent(self.peer_name)
        self.agent.deregister_memory(self.reg)


def worker(me: int, port: int, args: argparse.Namespace) -> None:
    from reshard.executors.nixl import NixlExecutor, NixlOptions

    gpu = args.gpu
    if gpu:
        torch.cuda.set_device(me)
        device = torch.device("cuda", me)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("nccl" if gpu else "gloo", store=dist.PrefixStore("pg", store), rank=me, world_size=2)
    host = dist.new_group(backend="gloo") if gpu else None
    clock = Clock(device, host)
    spec = qwen3_8b() if gpu else cpu_spec()
    results: dict = {"device": torch.cuda.get_device_name(device) if gpu else "cpu", "cases": {}}

    def report(*parts) -> None:
        if me == 0:
            print(*parts, flush=True)

    for case, (plan, binding) in cases(spec, gpu, args.sweep).items():
        if args.cases and case not in args.cases.split(","):
            continue
        nbytes = int(plan.op_bytes().sum())
        report(f"\n== {case}: {plan.src} -> {plan.dst}, {nbytes / GB:.3f} GB, {plan.num_ops} ops")
        rows = []
        iters = min(args.iters, 3) if case.startswith("rows-") else args.iters
        raw = RawNixl(me, nbytes, device, dist.PrefixStore(f"{case}/", store), args.delay_us)
        raw_t = {op: statistics.median(clock.time(lambda op=op: raw.run(op), iters)) for op in ("READ", "WRITE")}
        for op, t in raw_t.items():
            report(f"raw NIXL {op:5s} {t * 1e3:9.2f} ms  {nbytes / t / GB:8.2f} GB/s")
        baselines = {f"raw_{op.lower()}_s": t for op, t in raw_t.items()}
        if gpu:
            buf = raw.buf

            def sendrecv() -> None:
                if me == 0:
                    dist.send(buf, 1)
                else:
                    dist.recv(buf, 0)

            baselines["nccl_sendrecv_s"] = statistics.median(clock.time(sendrecv, iters))
            report(f"NCCL send/recv {baselines['nccl_sendrecv_s'] * 1e3:9.2f} ms  "
                   f"{nbytes / baselines['nccl_sendrecv_s'] / GB:8.2f} GB/s")
        elif me == 0:
            a, b = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
            ts = []
            for _ in range(iters + 1):
                t0 = time.perf_counter()
                b.copy_(a)
                ts.append(time.perf_counter() - t0)
            baselines["memcpy_s"] = statistics.median(ts[1:])
            report(f"memcpy (one process) {baselines['memcpy_s'] * 1e3:9.2f} ms  "
                   f"{nbytes / baselines['memcpy_s'] / GB:8.2f} GB/s")
            del a, b
        src = laid_out(plan.src, binding.src_ranks_of(me), device, seed=1)
        for k, v in enumerate(variants(case, gpu)):
            # zeros: a refit that moves nothing fails the check
            dst = laid_out(plan.dst, binding.dst_ranks_of(me), device, seed=None)
            opts = NixlOptions(timeout=20.0 if case.startswith("rows-") else 60.0, progress_delay_us=args.delay_us, **v)
            label = (f"{v['direction']:5s} {'staged' if v['staged'] else 'in place':8s} pack={v.get('pack', 'auto')}"
                     + (" land=off" if v.get("land_below") == 0 else ""))
            try:
                t0 = time.perf_counter()
                ex = NixlExecutor(plan, binding, me, src, dst, store=store, options=opts, namespace=f"{case}-{k}")
                setup = time.perf_counter() - t0
                stats = []
                op = "READ" if v["direction"] == "read" else "WRITE"
                times, raw_times = clock.paired(lambda: stats.append(ex.refit()), lambda: raw.run(op), iters)
                ok = matches(plan.dst, dst, device, seed=1, names=plan.selection) if me == 1 else True
                flag = torch.tensor([int(ok)])
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=host)
                last = stats[-1]
                info = torch.tensor([last.packed_transfers, last.descriptors, last.staging_bytes,
                                     *(statistics.median(s.phases.get(p, 0.0) for s in stats)
                                       for p in ("transfer", "agree", "commit"))], dtype=torch.float64)
                dist.all_reduce(info, op=dist.ReduceOp.MAX, group=host)
                ex.close()
            except Exception as e:  # keep measuring the other variants; the failure is reported
                report(f"{label}: FAILED {type(e).__name__}: {e}")
                rows.append({**v, "error": f"{type(e).__name__}: {e}"})
                continue
            t = statistics.median(times)
            raw_same = statistics.median(raw_times)
            row = {**v, "seconds": t, "gbps": nbytes / t / GB, "setup_s": setup, "verified": bool(flag.item()),
                   "raw_seconds": raw_same, "pct_of_raw_same_op": 100 * raw_same / t,
                   "pct_paired_median": 100 * statistics.median(r / x for r, x in zip(raw_times, times)),
                   "packed_transfers": int(info[0]), "descriptors": int(info[1]), "staging_bytes": int(info[2]),
                   "transfer_s": info[3].item(), "agree_s": info[4].item(), "commit_s": info[5].item(),
                   "all_s": times, "raw_all_s": raw_times}
            rows.append(row)
            report(f"{label}: {t * 1e3:8.2f} ms {row['gbps']:7.2f} GB/s | raw {op} alternating {raw_same * 1e3:8.2f} ms"
                   f" | {row['pct_of_raw_same_op']:5.1f}% of raw (paired median {row['pct_paired_median']:5.1f}%)  (transfer {row['transfer_s'] * 1e3:.1f} / "
                   f"agree {row['agree_s'] * 1e3:.1f} / commit {row['commit_s'] * 1e3:.1f} ms; "
                   f"{row['descriptors']} descriptors, {row['packed_transfers']} packed; set-up {setup:.2f} s; "
                   f"{'verified' if row['verified'] else 'WRONG BYTES'})")
            del dst
            ex = None  # frees its staging arena before the next variant allocates one
        raw.close()
        del raw
        results["cases"][case] = {"bytes": nbytes, "plan": f"{plan.src} -> {plan.dst}", "baselines": baselines,
                                  "variants": rows}
        del src
        if me == 0 and args.out:  # after every case: a run cut short keeps what it measured
            Path(args.out).write_text(json.dumps(results, indent=1))
    dist.barrier(group=host)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", action="store_true", help="two GPUs, E1 at Qwen3-8B shape")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--sweep", action="store_true", help="also packing against descriptors per row, by row size")
    ap.add_argument("--cases", default="", help="comma-separated case names to run (default: all)")
    ap.add_argument("--delay-us", type=int, default=1000, help="NIXL progress thread delay (us)")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    args = ap.parse_args()
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    import multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(i, store.port, args)) for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    if any(codes):
        sys.exit(f"benchmark processes exited with {codes}")


if __name__ == "__main__":
    main()
