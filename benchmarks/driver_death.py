"""A dead driver: how long a vLLM server takes to serve again by itself, and until a new driver's refit succeeded,
when trainer process 0 (the one that called init and drives the server) is SIGKILLed before, during or after the
byte transfer of a refit, over every cross-process transport. One vLLM CPU server (TP 2, reshard's lease middleware)
for every case; the ceiling printed beside each figure is the bound the design promises (the lease + the
transport's timeout) and a clean refit's time measured in the same run.

    .venv/bin/python benchmarks/driver_death.py --lease 3 --timeout 10 [--engine server|ray] [--json out.json]

`--engine ray`: a TP1 `VllmEngineActor` on a local Ray cluster instead (no pause: it serves meanwhile, so "serving
again" is when the engine had ended the dead driver's lease).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _harness_path  # noqa: E402,F401 - tests/ (the harness) on the path, here and in children

from harness.driver_faults import PHASES, kill_the_driver, refit_from_here  # noqa: E402
from reshard.testing.megatron_cpu import TinyGPT  # noqa: E402
from harness.serve import ServerProcess  # noqa: E402
from harness.serve_jobs import load_checkpoint, make_checkpoint, save_checkpoint, train_step  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 5], [17, 40, 3, 99]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lease", type=float, default=3.0, help="the driver's lease, seconds")
    parser.add_argument("--timeout", type=float, default=10.0, help="the transport's timeout, seconds")
    parser.add_argument("--transports", default="collective,shared,nixl")
    parser.add_argument("--engine", default="server", choices=["server", "ray"])
    parser.add_argument("--json", default=None, help="write the rows here too")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        a = make_checkpoint(TinyGPT(), work / "A")
        b = save_checkpoint({k: train_step(v, 1) for k, v in load_checkpoint(a).items()}, a, work / "B")
        with _engine(args.engine, b, work) as engine:
            served = b
            for transport in args.transports.split(","):
                other = a if served == b else b
                t0 = time.time()
                refit_from_here(engine, other, transport, f"clean-{transport}", timeout=args.timeout)
                clean, served = time.time() - t0, other
                for phase in PHASES:
                    other = a if served == b else b
                    case = kill_the_driver(engine, other, transport, phase, work=work / "cases",
                                           lease=args.lease, timeout=args.timeout, prompts=PROMPTS)
                    refit_at = refit_from_here(engine, other, transport, f"new-{transport}-{phase}",
                                               timeout=args.timeout)
                    served = other
                    serving = case["serving_at"] if args.engine == "server" else case["ended_at"]
                    rows.append({"engine": args.engine, "transport": transport, "phase": phase,
                                 "serving_s": serving - case["killed_at"],
                                 "refit_s": refit_at - case["killed_at"], "bound_s": args.lease + args.timeout,
                                 "clean_refit_s": clean, "kept_version": case["weight_version"]})
                    print(json.dumps(rows[-1]), flush=True)
    print(f"\nengine: {args.engine}")
    print("\n| transport | driver killed | serving again after | next refit succeeded after | bound (lease + "
          "timeout) | a clean init + refit |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['transport']} | {r['phase']} the transfer | {r['serving_s']:.1f} s | {r['refit_s']:.1f} s | "
              f"{r['bound_s']:.0f} s | {r['clean_refit_s']:.1f} s |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


@contextlib.contextmanager
def _engine(kind: str, checkpoint: Path, work: Path):
    if kind == "server":
        with ServerProcess(checkpoint, tp=2, log=work / "server.log") as server:
            yield {"url": server.url, "tp": 2}
        return
    import ray

    from reshard.adapters.ray import RayEngineClient
    from harness.ray_jobs import start_engine, stop_engine

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="reshard-bench")
    actor = start_engine(str(checkpoint), 1, name="bench-engine")
    try:
        RayEngineClient(actor, "bench-engine", timeout=900).greedy(PROMPTS[:1], max_tokens=1)
        yield {"ray_address": ray.get_runtime_context().gcs_address, "namespace": "reshard-bench",
               "name": "bench-engine", "tp": 1}
    finally:
        stop_engine(actor)
        ray.shutdown()


if __name__ == "__main__":
    main()
