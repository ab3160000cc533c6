"""Refits of vLLM engine actors from Megatron trainer actors on a local Ray cluster (the NeMo-RL shape): time per
refit and the trainers' egress as the number of engines grows, with and without fan-out (one replica relays to
the next), each beside one copy of the model (what the trainers must send at least once).

    .venv/bin/python benchmarks/refit_ray.py [--engines 1,2,4] [--refits 5] [--trainer-tp 2]

Engines are TP1 vLLM CPU engines in the vLLM virtualenv; the model is the tiny Qwen3 of the tests, so times are
the fixed costs of a refit (control calls, synchronization), not bandwidth.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import _harness_path  # noqa: E402,F401 - tests/ (the harness) on the path, here and in children


def main() -> int:
    import ray

    from reshard.testing.megatron_cpu import TinyGPT
    from harness.ray_jobs import open_group, refit_all, start_engine, start_trainers, stop_engine
    from harness.serve_jobs import load_checkpoint, make_checkpoint

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default="1,2,4")
    p.add_argument("--refits", type=int, default=5)
    p.add_argument("--trainer-tp", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="reshard-bench-ray-"))
    ckpt = make_checkpoint(TinyGPT(), work / "ckpt")
    model_bytes = sum(v.numel() * v.element_size() for v in load_checkpoint(ckpt).values())
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        trainers = start_trainers(a.trainer_tp, {"tp": a.trainer_tp, "checkpoint": str(ckpt)})
        for n in [int(x) for x in a.engines.split(",")]:
            engines = [start_engine(str(ckpt), 1) for _ in range(n)]
            try:
                for fanout in (None, 1):
                    group = {"name": f"x{n}", "dst": {"tp": 1, "replicas": n}, "fanout": fanout, "timeout": 300}
                    open_group(trainers, group, engines)
                    times, sent = [], 0
                    for i in range(a.refits + 1):
                        results = refit_all(trainers, f"v{i}", [group["name"]])
                        if not all(r[group["name"]]["ok"] for r in results):
                            raise RuntimeError(results)
                        if i:  # the first refit warms up
                            times.append(max(r[group["name"]]["seconds"] for r in results))
                            sent = sum(r[group["name"]]["bytes_sent"] for r in results)
                    rows.append({"engines": n, "fanout": fanout, "refit_s": statistics.median(times),
                                 "egress_bytes": sent, "model_bytes": model_bytes})
            finally:
                for e in engines:
                    stop_engine(e)
    finally:
        ray.shutdown()
    print(f"{a.trainer_tp} Megatron trainer actors -> N vLLM TP1 engine actors (tiny Qwen3, {model_bytes:,} B), "
          f"median of {a.refits} refits")
    print(f"{'engines':>7} {'fan-out':>8} {'refit':>9} {'trainer egress':>16} {'copies of the model':>20}")
    for r in rows:
        print(f"{r['engines']:>7} {str(r['fanout']):>8} {r['refit_s'] * 1e3:7.0f} ms {r['egress_bytes']:>16,} "
              f"{r['egress_bytes'] / model_bytes:>20.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
