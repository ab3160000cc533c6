"""A verl user selects reshard as the checkpoint engine; verl's own CheckpointEngineManager then refits the
rollout workers from the trainer workers through it. On CPU, over a local Ray cluster:

    .venv/bin/python examples/verl/refit.py [--trainers 2] [--rollouts 3] [--transport collective|shared|nixl]
                                            [--fanout K] [--steps 3]

(verl lives in .venv-verl, `scripts/bootstrap verl`: its pins differ from the core venv's; the script re-runs
itself there.) What a user writes is the config block below; cpu_stand_ins.py stands in for what verl runs on
GPUs (verl's own trainer and rollout worker classes, with a transformers Qwen3 instead of FSDP and vLLM).
Exits 1 unless every rollout worker serves exactly the trainer's weights after each step and the train-inference
mismatch (reshard.verify: the rollout models' log-probabilities of a few sequences against the trainer's) is within
the float32 thresholds.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
try:
    import verl  # noqa: F401
except ImportError:  # run again in the verl virtualenv
    venv = ROOT / ".venv-verl"
    if (venv / "bin/python").exists() and Path(sys.prefix).resolve() != venv.resolve():
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
        os.execv(str(venv / "bin/python"), [str(venv / "bin/python"), *sys.argv])
    sys.exit("verl is not installed here: run scripts/bootstrap verl (it makes .venv-verl)")

import ray  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3Config  # noqa: E402
from verl.checkpoint_engine import CheckpointEngineManager  # noqa: E402
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup  # noqa: E402
from verl.workers.config import CheckpointEngineConfig, RolloutConfig  # noqa: E402

from reshard.verify import Scores, compare, random_sequences  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cpu_stand_ins import Replica, Rollout, Trainer  # noqa: E402


def user_config(model_path: str, args: argparse.Namespace) -> dict:
    """What a verl user adds under actor_rollout_ref.rollout.checkpoint_engine."""
    return {"_target_": "verl.workers.config.CheckpointEngineConfig",
            "backend": "reshard",
            "custom_backend_module": "reshard.integrations.verl",
            "update_weights_bucket_megabytes": 1,
            "engine_kwargs": {"reshard": {"model": model_path, "transport": args.transport, "fanout": args.fanout,
                                          "checksum": True}}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--rollouts", type=int, default=3)
    parser.add_argument("--transport", default="collective", choices=["collective", "shared", "nixl"])
    parser.add_argument("--fanout", type=int, default=None)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    model_path = str(Path(tempfile.mkdtemp()) / "qwen3-tiny")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen3Config(
        vocab_size=4100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, tie_word_embeddings=False), dtype=torch.float32).save_pretrained(model_path)
    ce = user_config(model_path, args)

    ray.init(num_cpus=args.trainers + args.rollouts + 2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])}})
    config = OmegaConf.create({"actor": {"strategy": "fsdp"}, "rollout": {"checkpoint_engine": ce}})
    pools = [RayResourcePool([n], use_gpu=False, max_colocate_count=1) for n in (args.trainers, args.rollouts)]
    trainers = RayWorkerGroup(resource_pool=pools[0], device_name="cpu",
                              ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(Trainer), config=config,
                                                                     role="actor", model_path=model_path))
    trainers.init_model()
    rollout_config = RolloutConfig(name="vllm", tensor_model_parallel_size=1,
                                   checkpoint_engine=CheckpointEngineConfig(**ce))
    rollouts = RayWorkerGroup(resource_pool=pools[1], device_name="cpu",
                              ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(Rollout),
                                                                     rollout_config=rollout_config,
                                                                     model_path=model_path))
    replicas = []
    for r in range(args.rollouts):
        replicas.append(Replica(replica_rank=r, config=rollout_config, model_config=None))
        replicas[-1].workers = rollouts.workers[r:r + 1]
    manager = CheckpointEngineManager(CheckpointEngineConfig(**ce), trainers, replicas)

    sequences = random_sequences(4100, 3, 16)  # the model's vocabulary
    ok = True
    for step in range(1, args.steps + 1):
        expected = trainers.train_step(step)[0]
        metrics = manager.update_weights(global_steps=step)  # verl's refit: prepare, topology, send / receive
        served = rollouts.served()
        same = [s == expected for s in served]
        ok &= all(same)
        egress = [metrics[f"reshard/trainer{p}/egress_bytes"] / 2**20 for p in range(args.trainers)]
        print(f"step {step}: rollout workers equal to the trainer's weights: {same}; trainer egress MiB per rank: "
              + ", ".join(f"{e:.2f}" for e in egress))
        trainer_scores = Scores.of(*zip(*trainers.scores(sequences)[0]))
        for r, rows in enumerate(rollouts.scores(sequences)):
            report = compare(trainer_scores, Scores.of(*zip(*rows)), "float32")
            ok &= report.ok
            print(f"  rollout {r}: {report}")
    ray.shutdown()
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
