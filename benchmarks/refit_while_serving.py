"""Refits while a `vllm serve` keeps generating (issue 40, benchmark a): the vLLM CPU build under a bounded
continuous request loop (streamed greedy completions from `--clients` threads over loopback, harness.serving_load),
refit after refit from this process (one trainer rank, plain tensors, the collective transport, a loader install
with `RefitSpec(staging="device")`). Per refit: the transfer (the trainer's send until every engine worker has
its bytes and, on CPU, its shadow built: the driver's phases transfer + staged), the pause (the driver's first
pause call to the resume's answer: `RefitStats.pause_s`), the whole refit, the tokens the engine streamed while
the bytes landed and while paused, the requests held across the flip, the slowest worker's install, its wait for
the staged transfer and its kind (a shadow swapped in, or vLLM's reload: the worker extension's `reshard_stats`).
Beside them, the stall users see: the longest wait between two consecutive tokens of any stream across the install
window (the driver's pause, or without one its install call, to the refit's end; `stall_refit_s`: across the whole
refit), and the ceiling's context, the median inter-token gap outside refits in the same run (one decode step).
Goal: pause <= 10% of the transfer. Three cases in one run: `pause_for="flip"` (pause only for the install),
`pause_for="refit"` (today's default: the pause spans the whole refit), and `pause=None, pause_for="flip"` (no HTTP
pause: vLLM runs the install's worker RPC between two scheduler steps, on every worker in the same order, so the
install is itself the step-boundary stall and the streams go on on the new weights).

    .venv/bin/python benchmarks/refit_while_serving.py [--refits 8] [--tp 2] [--hidden 1024] [--layers 8] [--json out]
"""
from __future__ import annotations

import argparse
import json
import os
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
    from harness.serve_jobs import load_checkpoint, make_checkpoint, train_step
    from harness.serving_load import RequestLoop

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--refits", type=int, default=8)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--pause", default="keep", choices=["keep", "wait", "abort"])
    p.add_argument("--json", default=None)
    a = p.parse_args()
    tiny = TinyGPT(hidden_size=a.hidden, ffn_hidden_size=2 * a.hidden, num_layers=a.layers)
    work = Path(tempfile.mkdtemp(prefix="reshard-bench-"))
    ckpt = make_checkpoint(tiny, work / "ckpt")
    spec = reshard.ModelSpec.from_hf_config(ckpt)
    src = reshard.MegatronLayout(model=spec, vocab_divisor=64)
    tensors = shard(src, load_checkpoint(ckpt))[0]
    refit = RefitSpec.of(spec, src, reshard.VllmLayout(model=spec, tp=a.tp), install="loader", transport="collective",
                         staging="device")
    nbytes = refit.plan().accounting.total_bytes
    extension = ("--worker-extension-cls", "reshard.adapters.vllm.worker.ReshardWorkerExtension")
    out: dict = {"bytes": nbytes, "args": vars(a), "machine": f"{os.cpu_count()} CPUs", "runs": {}}
    cases = {"flip": (a.pause, "flip"), "refit": (a.pause, "refit"), "flip-nopause": (None, "flip")}
    with ServerProcess(ckpt, tp=a.tp, log=work / "server.log", extra_args=extension) as server:
        for case, (pause, pause_for) in cases.items():
            session = TrainerSession(refit, 0, tensors, engines=[server], pause=pause, pause_for=pause_for)
            session.init()
            rows, windows = [], []
            with RequestLoop(server.url, server.model(), clients=a.clients, max_tokens=a.max_tokens) as loop:
                time.sleep(2.0)
                for i in range(a.refits + 1):
                    for t in tensors.values():  # a training step: every byte changes
                        t.copy_(train_step(t, i + 1))
                    t0 = time.perf_counter()
                    r = session.refit(f"{case}-{i}")
                    ph, end = r.phases, t0 + r.seconds
                    land = ph["transfer"] + ph.get("staged", 0.0)
                    t_land = t0 + ph["start"]
                    # the install window: the driver's pause (pause_for="refit": from the start) or, without a
                    # pause, its install call, to the refit's end
                    flip_from = t0 if pause_for == "refit" else t_land + land
                    paused = end - r.stats.pause_s
                    windows.append((t0, end))
                    time.sleep(0.5)  # the streams' tokens after the refit arrive before the gaps are read
                    rows.append({"total_s": r.seconds, "transfer_s": land, "pause_s": r.stats.pause_s,
                                 "stall_s": loop.longest_gap(flip_from, end),
                                 "stall_refit_s": loop.longest_gap(t0, end),
                                 "phases": ph,
                                 "tokens_landing": loop.tokens_between(t_land, t_land + land) if land else 0,
                                 "tokens_paused": loop.tokens_between(paused, end),
                                 "in_flight": len(r.stats.in_flight or ()), **_worker_times(server)})
                errors = sum(1 for q in loop.requests if q.error)
                step_gap = loop.median_gap(outside=windows)
            session.close()
            rows = rows[1:]  # the first refit warms caches
            med = {k: statistics.median(row[k] for row in rows) for k in rows[0] if k != "phases"}
            med["phases"] = {k: statistics.median(row["phases"][k] for row in rows) for k in rows[0]["phases"]}
            med["request_errors"] = errors
            med["step_gap_s"] = step_gap
            out["runs"][case] = {"pause": pause, "pause_for": pause_for, "median": med, "refits": rows}
            print(f"{case}: pause={pause!r}, pause_for={pause_for!r}, median of {len(rows)} refits of "
                  f"{nbytes / 2**20:.0f} MiB into vllm:tp={a.tp} under {a.clients} streaming clients:")
            print(f"  transfer {med['transfer_s'] * 1e3:7.1f} ms   pause {med['pause_s'] * 1e3:7.1f} ms "
                  f"({med['pause_s'] / med['transfer_s']:.1%} of the transfer)   total {med['total_s'] * 1e3:7.1f} ms")
            print(f"  users' stall (longest inter-token gap across the install) {med['stall_s'] * 1e3:7.1f} ms "
                  f"({med['stall_s'] / med['transfer_s']:.1%} of the transfer); across the whole refit "
                  f"{med['stall_refit_s'] * 1e3:.1f} ms; median inter-token gap outside refits (one step) "
                  f"{step_gap * 1e3:.1f} ms")
            print(f"  tokens streamed while the bytes landed {med['tokens_landing']:.0f}, while paused "
                  f"{med['tokens_paused']:.0f}; requests held across the pause {med['in_flight']:.0f}; request "
                  f"errors {errors}")
            print("  phases: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in med["phases"].items()))
            print(f"  the slowest worker's install {med['flip_s'] * 1e3:.1f} ms, after waiting "
                  f"{med['tail_s'] * 1e3:.1f} ms for its staged transfer to end "
                  f"({'a shadow swapped in' if med['swap'] else 'vLLM reload'})")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


def _worker_times(server) -> dict:
    """The slowest worker's last install (`flip_s`), its wait for the staged transfer first (`tail_s`), and whether
    every worker's flip swapped a shadow in (`swap`, 1.0: adapters.vllm.staging) rather than reloading."""
    stats = server.collective_rpc("reshard_stats")
    times = {k: max(float(w.get(k, 0.0)) for w in stats) for k in ("flip_s", "tail_s")}
    return {**times, "swap": float(all(w.get("swap") for w in stats))}


if __name__ == "__main__":
    sys.exit(main())
