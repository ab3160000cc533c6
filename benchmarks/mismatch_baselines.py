"""Train-inference mismatch baselines (issue 30): what a correct refit looks like, per family and dtype, so that
reshard.verify's thresholds stand on measurements. For each (family, dtype): a random N(0, 1) checkpoint, a
`vllm serve` (vLLM CPU build) started fresh from it, megatron-core (TP=2, gloo, CPU) loaded with the same
checkpoint; the mismatch of the fresh server (the ceiling: no refit involved, only two engines'
arithmetic), then after one reshard refit of the same weights, and transformers (fp32) on the checkpoint
against the server (`reshard verify`); and the slice-sensitivity audit's worst relative response error of a
correct refit. In bfloat16 only the last comparison runs: the trainer side is transformers in fp32 on the same
bf16-valued weights (the usual RL setup: fp32 master weights, a bf16 engine). megatron-core's local spec on CPU
keeps RMSNorm weights in fp32 inside a bf16 model, which a bf16 layout refuses (a cast refit would be needed).
Prints a JSON line per measurement, then one table.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/mismatch_baselines.py [--families dense,moe] [--dtypes float32,bfloat16]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

import _harness_path  # noqa: E402,F401 - tests/ (the harness) on the path, here and in children
from reshard.adapters.server import VllmServer
from reshard.testing.megatron_cpu import TinyGPT, run_ranks
from harness.serve import ServerProcess
from harness.serve_jobs import load_checkpoint, make_checkpoint, save_checkpoint
from harness.verify_jobs import verify_server
from reshard.verify import compare
from reshard.verify.checkpoint import checkpoint_scores, random_sequences
from reshard.verify.sides import engine_scores

FAMILIES = {"dense": {"num_layers": 2}, "moe": {"num_layers": 2, "num_experts": 4}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="dense,moe")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--length", type=int, default=32)
    args = ap.parse_args()
    rows = []
    for family in args.families.split(","):
        fields = FAMILIES[family]
        tiny = TinyGPT(**fields)
        seqs = random_sequences(tiny.vocab_size, args.sequences, args.length)
        for dtype in args.dtypes.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                ckpt = make_checkpoint(tiny, Path(tmp, "A"))
                if dtype != "float32":  # the checkpoint in the served dtype: trainer and server hold the same bits
                    weights = {k: v.to(getattr(torch, dtype)) for k, v in load_checkpoint(ckpt).items()}
                    ckpt = save_checkpoint(weights, ckpt, Path(tmp, "A-" + dtype))
                    config = json.loads((ckpt / "config.json").read_text())
                    (ckpt / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype, "dtype": dtype}))
                out = Path(tmp, "out.json")
                t0 = time.monotonic()
                with ServerProcess(ckpt, tp=1, log=Path(tmp, "server.log"), dtype=dtype) as server:
                    start = time.monotonic() - t0
                    if dtype == "float32":
                        job = {"tiny": fields, "tp": 2, "url": server.url, "checkpoint": str(ckpt), "dtype": dtype,
                               "sequences": seqs, "out": str(out), "bugs": []}
                        run_ranks(2, verify_server, job, timeout=1200, errdir=tmp)
                    hf = compare(checkpoint_scores(ckpt, seqs), engine_scores(VllmServer(server.url), seqs), dtype)
                result = json.loads(out.read_text()) if dtype == "float32" else {}
                if "exception" in result:
                    print(result["exception"], file=sys.stderr)
                    return 1
                measured = [("fresh server vs megatron", result["fresh"]), ("after refit vs megatron", result["clean"])
                            ] if result else []
                for what, r in measured + [("fresh server vs HF fp32", hf.to_dict())]:
                    rows.append((family, dtype, what, r, result.get("measure_s", 0.0), start))
                    print(json.dumps({"family": family, "dtype": dtype, "what": what, **r}), flush=True)
                if result:
                    audit = result["audit_clean"]["entries"]
                    worst = max(e["relative_error"] for e in audit if e["status"] != "no response")
                    print(json.dumps({"family": family, "dtype": dtype, "audit_worst_relative_error": worst,
                                      "audit": [(e["tensor"], e["status"], e["relative_error"]) for e in audit]}),
                          flush=True)
    print(f"machine: {platform.node()} {platform.processor() or platform.machine()}, CPU only; "
          f"{args.sequences} sequences x {args.length} tokens, tiny 2-layer models (N(0,1) weights)")
    print(f"{'family':<6} {'dtype':<9} {'comparison':<26} {'mean|d|':>9} {'p99|d|':>9} {'max|d|':>9} "
          f"{'KL k3':>9} {'argmax':>7} {'ok':>3}")
    for family, dtype, what, r, _, _ in rows:
        print(f"{family:<6} {dtype:<9} {what:<26} {r['mean_abs']:9.2e} {r['p99_abs']:9.2e} {r['max_abs']:9.2e} "
              f"{r['mean_k3']:9.2e} {r['argmax_agreement']:7.3f} {'yes' if r['ok'] else 'NO':>3}")
    print(f"server start {min(s for *_, s in rows):.0f}-{max(s for *_, s in rows):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
