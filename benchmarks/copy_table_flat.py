"""The table-copy kernel's own ceiling (kernels.copy_table): one flat copy of --gib GiB, torch's copy (the device
copy every refit figure is measured against) beside each tuning (KernelTuning's chunk bytes and warps; the cache
hints, one block in flight and persistent grid this once swept were removed in 55d766f), same run; each tuning's
bytes checked.

    python benchmarks/copy_table_flat.py --gib 8 --json out.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> int:
    from reshard.kernels import KernelTuning
    from reshard.kernels.copy_table import CopyTable

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    n = int(args.gib * (1 << 30)) // 16 * 16
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), args.iters)
    rows = [{"variant": "torch copy_", "s": copy_s, "of_copy": 1.0, "equal": True}]
    print(f"| variant | ms | of torch's copy | bytes equal |\n| --- | --- | --- | --- |\n"
          f"| torch copy_ ({args.gib:g} GiB) | {copy_s * 1e3:.3f} | 100% | |", flush=True)
    for chunk, warps in itertools.product((32, 48, 64, 256, 1024, 4096), (8, 16)):
        dst.zero_()
        table = CopyTable([(dst, src)], KernelTuning(copy_chunk_bytes=chunk << 10, copy_warps=warps))
        s = timed(table.launch, args.iters)
        equal = bool(torch.equal(dst, src))
        name = f"chunk={chunk}K,warps={warps}"
        rows.append({"variant": name, "s": s, "of_copy": copy_s / s, "equal": equal})
        print(f"| {name} | {s * 1e3:.3f} | {copy_s / s:.1%} | {equal} |", flush=True)
    best = max(rows[1:], key=lambda r: r["of_copy"])
    print(f"best: {best['variant']} {best['of_copy']:.1%} of torch's copy", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                               "gib": args.gib, "rows": rows}, indent=1))
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
