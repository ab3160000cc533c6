"""Compile speed at cluster scale, beside PyTorch's checkpoint planner on the same intersections.

    python benchmarks/compile_scale.py                 # the three cases, each in a fresh single-threaded process
    python benchmarks/compile_scale.py --case 235b     # one case
    python benchmarks/compile_scale.py --json out.json

Per case, in one fresh process (OMP/MKL/OpenBLAS threads = 1; numpy's sorts are single-threaded anyway):
  reshard   `reshard.compile(src, dst)`: placements of both layouts, intersections, merging, sender choice,
            coverage proof, accounting, digest. CPU seconds (process time: the machine is shared, so wall time
            is reported too but CPU time is the figure), best of --repeat runs; peak memory as the process's peak
            RSS after the compile minus before it, and as the peak of numpy/Python allocations (tracemalloc) in
            a separate run.
  DCP       torch.distributed.checkpoint's `create_read_items_for_chunk_list` (the resharding step of its load
            planner) over identical chunk lists: per canonical tensor, the saved chunks are the distinct source
            boxes, and every destination rank of one replica calls it with its own boxes of the tensor (the
            intersections reshard computes; reshard repeats them for the other replicas without recomputing).
            Only the calls are timed, not building the metadata. With --dcp-sample N < 1 it runs on that
            fraction of the tensors (every k-th, so all roles are sampled) and extrapolates by the number of
            calls; the output says so.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CASES = {
    "30b": ("Qwen3-30B-A3B", "examples/configs/qwen3-30b-a3b.json",
            "megatron:tp=2,pp=2,ep=8,etp=1,world=16", "vllm:tp=2,replicas=8"),
    "235b": ("Qwen3-235B-A22B", "examples/configs/qwen3-235b-a22b.json",
             "megatron:tp=4,pp=8,ep=16,etp=1,world=128,first_stage_layers=11,last_stage_layers=11",
             "vllm:tp=8,replicas=8"),
    "1t": ("MoE-1T (Qwen3-MoE shape)", "examples/configs/moe-1t.json",
           "megatron:tp=8,pp=8,ep=64,etp=1,world=1024,first_stage_layers=7,last_stage_layers=6",
           "vllm:tp=16,replicas=16"),
}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_reshard(case: str, repeat: int, fanout: int | None) -> dict:
    sys.path.insert(0, str(ROOT))
    import reshard

    _, config, s, d = CASES[case]
    model = reshard.ModelSpec.from_hf_config(ROOT / config)
    src, dst = reshard.parse_layout(s, model), reshard.parse_layout(d, model)
    kw = {"fanout": fanout} if fanout else {}
    reshard.compile(src, dst, layers=[0], **kw)  # warm imports and small caches, not the model's
    before = _rss_mib()
    cpu, wall = [], []
    plan = None
    for _ in range(repeat):
        plan = None
        t, w = time.process_time(), time.perf_counter()
        plan = reshard.compile(src, dst, **kw)
        cpu.append(time.process_time() - t)
        wall.append(time.perf_counter() - w)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    import tracemalloc

    plan = None
    tracemalloc.start()
    plan = reshard.compile(src, dst, **kw)
    traced_peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    a = plan.accounting
    return {
        "case": case, "model": str(model), "src": str(src), "dst": str(dst), "fanout": fanout,
        "ops": a.num_ops, "template_ops": plan.program.num_template_ops, "transfers": a.num_transfers,
        "compile_cpu_s": min(cpu), "compile_cpu_s_all": cpu, "compile_wall_s": min(wall),
        "peak_rss_mib": peak_rss, "rss_before_mib": before, "compile_peak_rss_mib": peak_rss - before,
        "traced_peak_mib": traced_peak, "total_bytes": a.total_bytes, "egress_balance": a.egress_balance,
        "egress_optimality": a.egress_optimality, "digest": plan.digest,
    }


def run_dcp(case: str, sample: float) -> dict:
    sys.path.insert(0, str(ROOT))
    import numpy as np
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    import reshard

    _, config, s, d = CASES[case]
    model = reshard.ModelSpec.from_hf_config(ROOT / config)
    src, dst = reshard.parse_layout(s, model), reshard.parse_layout(d, model)
    c = model.canonical
    n = len(c)
    step = max(1, round(1 / sample)) if sample < 1 else 1
    index = np.arange(0, n, step)
    S = src.placement_table(index)
    D = dst.placement_table(index, replica=0)
    props = TensorProperties(dtype=torch.bfloat16)
    # Per canonical tensor: distinct source boxes (the saved chunks) and each destination rank's boxes.
    s_key = np.stack([S.canon, S.c0, S.c1, S.n0, S.n1], axis=1)[S.n0 * S.n1 > 0]
    s_key = np.unique(s_key, axis=0)
    d_rows = np.flatnonzero(D.n0 * D.n1 > 0)
    d_order = d_rows[np.lexsort((D.rank[d_rows], D.canon[d_rows]))]
    s_first = np.searchsorted(s_key[:, 0], index)
    s_last = np.searchsorted(s_key[:, 0], index, side="right")
    d_canon = D.canon[d_order]
    d_first = np.searchsorted(d_canon, index)
    d_last = np.searchsorted(d_canon, index, side="right")
    seconds, calls, items = 0.0, 0, 0
    for k, t in enumerate(index.tolist()):
        name = model.tensor_name(t)
        one_d = c.ndim[t] == 1

        def chunk(c0, c1, n0, n1):
            return ChunkStorageMetadata(offsets=torch.Size([c1] if one_d else [c0, c1]),
                                        sizes=torch.Size([n1] if one_d else [n0, n1]))

        size = torch.Size([int(c.cols[t])] if one_d else [int(c.rows[t]), int(c.cols[t])])
        saved = [chunk(*row[1:].tolist()) for row in s_key[s_first[k]:s_last[k]]]
        md = TensorStorageMetadata(properties=props, size=size, chunks=saved)
        rows = d_order[d_first[k]:d_last[k]]
        by_rank: dict[int, list] = {}
        for r, c0, c1, n0, n1 in zip(*(x[rows].tolist() for x in (D.rank, D.c0, D.c1, D.n0, D.n1))):
            by_rank.setdefault(r, []).append(chunk(c0, c1, n0, n1))
        lists = list(by_rank.values())
        t0 = time.process_time()
        for local in lists:
            items += len(create_read_items_for_chunk_list(name, md, local))
        seconds += time.process_time() - t0
        calls += len(lists)
    scale = n / len(index)
    return {"case": case, "dcp_cpu_s": seconds * scale, "dcp_measured_cpu_s": seconds, "dcp_calls": calls,
            "dcp_read_items": items, "dcp_sampled_fraction": len(index) / n,
            "dcp_extrapolated": len(index) < n, "torch": torch.__version__}


def child(args: argparse.Namespace) -> None:
    out = run_reshard(args.case, args.repeat, args.fanout) if args.what == "reshard" else run_dcp(args.case,
                                                                                                   args.dcp_sample)
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=sorted(CASES), action="append")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--fanout", type=int, help="compile with fan-out trees too")
    p.add_argument("--dcp-sample", type=float, default=1.0, help="fraction of tensors for the DCP peer")
    p.add_argument("--no-dcp", action="store_true")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--child", choices=["reshard", "dcp"], dest="what", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.what:
        args.case = args.case[0]
        return child(args)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    results = []
    for case in args.case or list(CASES):
        row = {}
        for what in ("reshard",) + (() if args.no_dcp else ("dcp",)):
            cmd = [sys.executable, __file__, "--child", what, "--case", case, "--repeat", str(args.repeat),
                   "--dcp-sample", str(args.dcp_sample)] + (["--fanout", str(args.fanout)] if args.fanout else [])
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if proc.returncode:
                sys.exit(f"{what} {case} failed:\n{proc.stderr}")
            row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
        results.append(row)
        label = CASES[case][0]
        print(f"{label}: {row['src']} -> {row['dst']}")
        print(f"  reshard  {row['ops']:>12,} ops ({row['template_ops']:,} per replica), {row['transfers']:,} transfers"
              f"; compile {row['compile_cpu_s']:.3f} s CPU (wall {row['compile_wall_s']:.3f} s); peak memory "
              f"{row['compile_peak_rss_mib']:.0f} MiB RSS over the process's {row['rss_before_mib']:.0f} MiB, "
              f"{row['traced_peak_mib']:.0f} MiB traced; busiest sender {row['egress_optimality']:.4f}x of its bound")
        if "dcp_cpu_s" in row:
            how = (f"extrapolated from {row['dcp_sampled_fraction']:.1%} of the tensors" if row["dcp_extrapolated"]
                   else "all tensors")
            print(f"  DCP      {row['dcp_calls']:,} read-item calls, {row['dcp_read_items']:,} read items; "
                  f"{row['dcp_cpu_s']:.2f} s CPU ({how}); reshard is {row['dcp_cpu_s'] / row['compile_cpu_s']:.1f}x "
                  f"faster (and does more: merging, sender choice, coverage proof, accounting, all replicas)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
