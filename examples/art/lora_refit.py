"""Refit a LoRA adapter served by a running vLLM server straight into its slot, from Megatron-Bridge-shaped trainer
processes, the way ART trains and serves adapters: the server in its own virtualenv (the vLLM CPU build), the
trainer in this one, which has no vLLM. No adapter files are written after the first.

    .venv/bin/python examples/art/lora_refit.py [--transport collective|shared|nixl] [--server-tp 2]

What a user writes is `trainer()`: each trainer process holds its shards of the adapter (Megatron-Bridge's LoRA at
TP 2: `MegatronLayout` of `lora_spec(model, rank, alpha)`), and a `TrainerSession(install="lora_slot")` writes
them into the slot of the adapter the server already serves, through the reshard worker extension
(`ExtensionClient`; vLLM's weight-transfer API would drop the adapter when an update finishes).

1. makes a tiny Qwen3 checkpoint and a first rank-8 adapter, published as a PEFT directory;
2. starts `vllm serve` with LoRA and the reshard worker extension (serve.py), and serves the adapter as "policy";
3. for each of two "training steps", the adapter's next values: `peft` saves them itself (ground truth,
   independent of reshard) and the server loads that copy as "reference-<step>"; two trainer processes refit
   "policy"'s slot in the server's workers with the same values over the transport;
4. exits 0 only if, after each refit, greedy completions by "policy" equal those by that step's reference.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import reshard
from reshard.ports import free_port
from reshard.adapters.lora import PeftDirectory
from reshard.executors import execute_local, shard
from reshard.layouts.lora import PeftLayout, lora_spec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from refit import make_checkpoints  # noqa: E402 - this folder's tiny Qwen3 checkpoint
from serve import VllmServe, vllm_python  # noqa: E402 - this folder's launcher of `vllm serve`

PROMPTS = [[1, 5, 9, 13, 2], [7, 3, 3, 8], [64, 65, 66, 7, 7, 80]]
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA, STEPS = 8, 16, (101, 102)  # the adapter's values after each training step (seeds)
FUSED_A = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
           "up_proj": "gate_up_proj"}  # PEFT module -> reshard's canonical module holding its (shared) A


def adapter_weights(spec: reshard.ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """The adapter's values after a training step: random canonical tensors (B non-zero, so it changes tokens)."""
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=g) * 0.5 for t in spec.tensors}


def save_with_peft(checkpoint: Path, weights: dict[str, torch.Tensor], out: Path) -> Path:
    """The same adapter saved by `peft` itself (get_peft_model, its LoRA parameters set, save_pretrained)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32),
                           LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=MODULES, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:  # base_model.model.model.layers.0.self_attn.k_proj.lora_A.default.weight
                parts = name.removeprefix("base_model.model.").replace(".default.", ".").split(".")
                if parts[-2] == "lora_A":
                    parts[-3] = FUSED_A.get(parts[-3], parts[-3])
                p.copy_(weights[".".join(parts)])
    model.save_pretrained(str(out))
    return out


def trainer(rank: int, job: dict[str, Any]) -> None:
    """One trainer process: refit the served adapter's slot with each step's values."""
    import torch.distributed as dist

    from reshard.adapters import RefitSpec, TrainerSession, VllmServer
    from reshard.adapters.server import ExtensionClient
    from reshard.layouts.lora import VllmLoraLayout

    spec = lora_spec(reshard.ModelSpec.from_hf_config(job["checkpoint"]), RANK, ALPHA)
    src = reshard.MegatronLayout(model=spec, tp=dist.get_world_size())  # the trainer's adapter shards
    dst = VllmLoraLayout(model=spec, tp=job["server_tp"], max_lora_rank=RANK)
    # config: the base model's, whose fields that change the math but no shape (MoE top-k, norm epsilon, rope ...)
    # the server compares with its own (an adapter spec is a model of its own and carries none)
    refit = RefitSpec.of(spec, src, dst, install="lora_slot", lora_id=job["lora_id"], transport=job["transport"],
                         config=job["checkpoint"])
    server = VllmServer(job["url"]) if rank == 0 else None
    out: dict[str, Any] = {"refits": []}
    for seed in STEPS:
        tensors = shard(src, adapter_weights(spec, seed), ranks=[rank])[rank]  # (a trainer has them already)
        session = TrainerSession(refit, rank, tensors, engines=[ExtensionClient(server)] if server else [],
                                 trainer_group=dist.group.WORLD)
        try:
            session.init()
            result = session.refit(f"adapter-{seed}")
        finally:
            session.close()
        if server is not None:
            server.call("POST", "/reset_prefix_cache")
            out["refits"].append({"seconds": result.seconds,
                                  "tokens": server.greedy(PROMPTS, max_tokens=8, model="policy")})
    if rank == 0:
        Path(job["out"]).write_text(json.dumps(out))


def _process(rank: int, world: int, port: int, job: dict[str, Any]) -> None:
    import datetime

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    trainer(rank, job)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transport", default="collective", choices=["collective", "shared", "nixl"])
    p.add_argument("--server-tp", type=int, default=2)
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    if not vllm_python().exists():
        print(f"no vLLM CPU virtualenv at {vllm_python()}: run scripts/bootstrap vllm first", file=sys.stderr)
        return 2
    import torch.multiprocessing as mp

    work = Path(args.workdir or tempfile.mkdtemp(prefix="reshard-art-lora-"))
    checkpoint, _ = make_checkpoints(work)
    spec = lora_spec(reshard.ModelSpec.from_hf_config(checkpoint), RANK, ALPHA)
    trainer_layout = reshard.MegatronLayout(model=spec, tp=2)
    served = PeftDirectory(work / "adapters" / "policy", PeftLayout(model=spec), base_model=str(checkpoint))
    execute_local(reshard.compile(trainer_layout, served.layout), shard(trainer_layout, adapter_weights(spec, 100)),
                  {0: served.tensors})  # the first adapter, published as a PEFT directory for the server to load
    served.publish("step-0")
    extra = ("--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "2", "--max-cpu-loras", "4",
             "--worker-extension-cls", "reshard.adapters.vllm.worker.ReshardWorkerExtension")
    t0 = time.perf_counter()
    with VllmServe(vllm_python(), checkpoint, tp=args.server_tp, log=work / "server.log", extra_args=extra,
                   env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as server:
        lora_id = server.load_lora_adapter("policy", str(served.path))
        print(f"server {server.url} (tp={args.server_tp}) serving adapter 'policy' (id {lora_id}) after "
              f"{time.perf_counter() - t0:.0f} s; log {work / 'server.log'}")
        expected = []
        for step, seed in enumerate(STEPS, 1):
            path = save_with_peft(checkpoint, adapter_weights(spec, seed), work / f"peft-{step}")
            server.load_lora_adapter(f"reference-{step}", str(path))
            expected.append(server.greedy(PROMPTS, max_tokens=8, model=f"reference-{step}"))
        port = free_port()
        job = {"checkpoint": str(checkpoint), "server_tp": args.server_tp, "url": server.url, "lora_id": lora_id,
               "transport": args.transport, "out": str(work / "trainer.json")}
        mp.start_processes(_process, args=(2, port, job), nprocs=2, join=True, start_method="spawn")
    out = json.loads((work / "trainer.json").read_text())
    ok = True
    for step, (refit, want) in enumerate(zip(out["refits"], expected), 1):
        same = refit["tokens"] == want
        ok &= same
        print(f"step {step}: slot refit over {args.transport} in {refit['seconds'] * 1e3:.0f} ms; greedy tokens by "
              f"'policy' {'equal' if same else 'DIFFER from'} the adapter peft saved")
    ok &= len(out["refits"]) == len(STEPS)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
