"""A dead driver: how long a vLLM server takes to serve again by itself, and until a new driver's refit succeeded,
when trainer process 0 (the one that called init and drives the server) is SIGKILLed before, during or after the
byte transfer of a refit, over every cross-process transport. One vLLM CPU server (TP 2, reshard's lease middleware)
for every case; the ceiling printed beside each figure is the bound the design promises (the lease + the
transport's timeout) and a clean refit's time measured in the same run.

    .venv/bin/python benchmarks/driver_death.py --lease 3 --timeout 10 [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reshard.testing.driver_faults import PHASES, kill_the_driver, refit_from_here  # noqa: E402
from reshard.testing.megatron_cpu import TinyGPT  # noqa: E402
from reshard.testing.serve import ServerProcess  # noqa: E402
from reshard.testing.serve_jobs import load_checkpoint, make_checkpoint, save_checkpoint, train_step  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 5], [17, 40, 3, 99]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lease", type=float, default=3.0, help="the driver's lease, seconds")
    parser.add_argument("--timeout", type=float, default=10.0, help="the transport's timeout, seconds")
    parser.add_argument("--transports", default="collective,shared,nixl")
    parser.add_argument("--json", default=None, help="write the rows here too")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        a = make_checkpoint(TinyGPT(), work / "A")
        b = save_checkpoint({k: train_step(v, 1) for k, v in load_checkpoint(a).items()}, a, work / "B")
        with ServerProcess(b, tp=2, log=work / "server.log") as server:
            served, engine = b, {"url": server.url, "tp": 2}
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
                    rows.append({"transport": transport, "phase": phase,
                                 "serving_s": case["serving_at"] - case["killed_at"],
                                 "refit_s": refit_at - case["killed_at"], "bound_s": args.lease + args.timeout,
                                 "clean_refit_s": clean, "kept_version": case["weight_version"]})
                    print(json.dumps(rows[-1]), flush=True)
    print("\n| transport | driver killed | serving again after | next refit succeeded after | bound (lease + "
          "timeout) | a clean init + refit |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['transport']} | {r['phase']} the transfer | {r['serving_s']:.1f} s | {r['refit_s']:.1f} s | "
              f"{r['bound_s']:.0f} s | {r['clean_refit_s']:.1f} s |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
