"""The fixed cost of refitting a running vLLM server over its HTTP routes, on a tiny model (where bytes cost
nothing): each step of a refit (pause + start, the transfer, the engine's update and install, finish + resume)
beside one HTTP round trip of a route that does nothing (GET /weight_info), measured in the same run.

The server is the vLLM CPU build in its own virtualenv (harness.serve); the trainer is this process,
one rank, plain tensors (no Megatron: its start-up is not what is measured).

    .venv/bin/python benchmarks/refit_server.py [--transport collective|shared|nixl] [--refits 20] [--tp 1]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import _harness_path  # noqa: E402,F401 - tests/ (the harness) on the path, here and in children


def main() -> int:
    import reshard
    from reshard.adapters import RefitSpec, TrainerSession
    from reshard.executors import shard
    from reshard.testing.megatron_cpu import TinyGPT
    from harness.serve import ServerProcess
    from harness.serve_jobs import load_checkpoint, make_checkpoint

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transport", default="collective", choices=["collective", "shared", "nixl"])
    p.add_argument("--refits", type=int, default=20)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="reshard-bench-"))
    ckpt = make_checkpoint(TinyGPT(), work / "ckpt")
    spec = reshard.ModelSpec.from_hf_config(ckpt)
    src = reshard.MegatronLayout(model=spec, vocab_divisor=64)
    tensors = shard(src, load_checkpoint(ckpt))[0]
    refit = RefitSpec.of(spec, src, reshard.VllmLayout(model=spec, tp=a.tp), install="loader", transport=a.transport)
    with ServerProcess(ckpt, tp=a.tp, log=work / "server.log") as server:
        session = TrainerSession(refit, 0, tensors, engines=[server])
        session.init()
        phases, totals, pauses, round_trips = [], [], [], []
        for i in range(a.refits + 1):
            result = session.refit(version=str(i))
            if i:  # the first refit warms caches
                phases.append(result.phases)
                totals.append(result.seconds)
                pauses.append(result.stats.pause_s)
            t0 = time.perf_counter()
            server.weight_info()
            round_trips.append(time.perf_counter() - t0)
        session.close()
    nbytes = refit.plan().accounting.total_bytes
    med = {k: statistics.median(ph[k] for ph in phases) for k in phases[0]}
    rt = statistics.median(round_trips)
    print(f"tiny Qwen3 ({nbytes / 2**20:.1f} MiB) -> vllm:tp={a.tp} server over {a.transport!r}, median of {a.refits} "
          f"refits")
    print(f"  one HTTP round trip (GET /weight_info): {rt * 1e3:.1f} ms")
    names = {"start": "pause + start", "transfer": "transfer (trainer side)", "engines": "update (the engine's "
             "transfer + install)", "finish": "finish", "resume": "resume"}
    for k, v in med.items():
        print(f"  {names.get(k, k):<36} {v * 1e3:7.1f} ms")
    print(f"  {'whole refit':<36} {statistics.median(totals) * 1e3:7.1f} ms")
    print(f"  {'paused (pause call to resume)':<36} {statistics.median(pauses) * 1e3:7.1f} ms")
    if a.json:
        Path(a.json).write_text(json.dumps({"bytes": nbytes, "round_trip_s": rt, "phases_s": med,
                                            "total_s": statistics.median(totals),
                                            "pause_s": statistics.median(pauses), "args": vars(a)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
