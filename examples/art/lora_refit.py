"""Refit a LoRA adapter served by a running vLLM server straight into its slot, from Megatron-Bridge-shaped trainer
processes, the way ART trains and serves adapters: the server in its own virtualenv (the vLLM CPU build), the
trainer in this one, which has no vLLM. No adapter files are written after the first.

    .venv/bin/python examples/art/lora_refit.py [--transport collective|shared|nixl] [--server-tp 2]

1. makes a tiny Qwen3 checkpoint and a first rank-8 adapter, published as a PEFT directory (landing b);
2. starts `vllm serve` with LoRA and the reshard worker extension, and serves the adapter as "policy";
3. for each of two "training steps", the adapter's next values: `peft` saves them itself (ground truth,
   independent of reshard) and the server loads that copy as "reference-<step>"; two trainer processes (the
   adapter at TP 2) refit "policy"'s slot in the server's workers with the same values over the transport
   (TrainerSession(install="lora_slot") through ExtensionClient);
4. exits 0 only if, after each refit, greedy completions by "policy" equal those by that step's reference.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import reshard
from reshard.adapters.lora import PeftDirectory
from reshard.executors import execute_local, shard
from reshard.layouts.lora import PeftLayout, lora_spec
from reshard.testing.lora import adapter_weights, save_with_peft, slot_refit_job
from reshard.testing.megatron_cpu import TinyGPT, run_ranks
from reshard.testing.serve import ServerProcess, vllm_cpu_python
from reshard.testing.serve_jobs import make_checkpoint

PROMPTS = [[1, 5, 9, 13, 2], [7, 3, 3, 8], [64, 65, 66, 7, 7, 80]]
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA, STEPS = 8, 16, (101, 102)  # the adapter's values after each training step (seeds)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transport", default="collective", choices=["collective", "shared", "nixl"])
    p.add_argument("--server-tp", type=int, default=2)
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    if vllm_cpu_python() is None:
        print("no vLLM CPU virtualenv: run scripts/bootstrap vllm first", file=sys.stderr)
        return 2
    work = Path(args.workdir or tempfile.mkdtemp(prefix="reshard-art-lora-"))
    tiny = TinyGPT(num_layers=2)
    checkpoint = make_checkpoint(tiny, work / "base")
    spec = lora_spec(tiny.spec(), RANK, ALPHA)
    trainer = reshard.MegatronLayout(model=spec, tp=2)
    served = PeftDirectory(work / "adapters" / "policy", PeftLayout(model=spec), base_model=str(checkpoint))
    execute_local(reshard.compile(trainer, served.layout), shard(trainer, adapter_weights(spec, 100)),
                  {0: served.tensors})
    served.publish("step-0")
    extra = ("--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "2", "--max-cpu-loras", "4",
             "--worker-extension-cls", "reshard.adapters.vllm.worker.ReshardWorkerExtension")
    t0 = time.perf_counter()
    with ServerProcess(checkpoint, tp=args.server_tp, log=work / "server.log", max_model_len=128,
                       env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}, extra_args=extra) as server:
        lora_id = server.load_lora_adapter("policy", str(served.path))
        print(f"server {server.url} (tp={args.server_tp}) serving adapter 'policy' (id {lora_id}) after "
              f"{time.perf_counter() - t0:.0f} s; log {work / 'server.log'}")
        expected = []
        for step, seed in enumerate(STEPS, 1):
            path = save_with_peft(checkpoint, adapter_weights(spec, seed), RANK, ALPHA, MODULES, work / f"peft-{step}")
            server.load_lora_adapter(f"reference-{step}", str(path))
            expected.append(server.greedy(PROMPTS, max_tokens=8, model=f"reference-{step}"))
        job = {"checkpoint": str(checkpoint), "rank": RANK, "alpha": ALPHA, "max_lora_rank": RANK,
               "server_tp": args.server_tp, "url": server.url, "name": "policy", "lora_id": lora_id,
               "transports": [args.transport] * len(STEPS), "seeds": list(STEPS), "prompts": PROMPTS,
               "out": str(work / "trainer.json")}
        run_ranks(2, slot_refit_job, job, timeout=900, errdir=str(work))
    out = json.loads((work / "trainer.json").read_text())
    if "exception" in out:
        print(out["exception"], file=sys.stderr)
        return 1
    ok = True
    for step, (refit, want) in enumerate(zip(out["refits"], expected), 1):
        same = refit["tokens"] == want
        ok &= same
        print(f"step {step}: slot refit over {args.transport} in {refit['seconds'] * 1e3:.0f} ms; greedy tokens by "
              f"'policy' {'equal' if same else 'DIFFER from'} the adapter peft saved")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
