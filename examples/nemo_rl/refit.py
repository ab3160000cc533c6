"""reshard as NeMo-RL's refit transport: `ReshardCheckpointEngine` driven in NeMo-RL's call order, policy workers
and a vLLM engine as Ray actors in separate processes (and virtualenvs), on CPU.

    .venv/bin/python examples/nemo_rl/refit.py [--policy-workers 2] [--tp 1]

In NeMo-RL this is configuration only:

    policy.generation.refit_transport: "reshard.integrations.nemo_rl:ReshardCheckpointEngine"
    policy.generation.refit_cfg."reshard.integrations.nemo_rl:ReshardCheckpointEngine": {model: <checkpoint>}

NeMo-RL is not installed here (it needs Python >= 3.13 and GPUs), so this file plays its part: `Synchronizer`
replays CheckpointEngineWeightSynchronizer (init_checkpoint_engine, prepare, init process groups, then per refit
send_weights_via_checkpoint_engine on every policy worker while every vLLM worker updates from the engine),
`PolicyWorker` NeMo-RL's Megatron policy worker (its HF iterator, filtered as NeMo-RL filters it by the engine's
target layout: the engine answers None, so every worker hands it the whole stream), and vllm_side.py the vLLM
generation worker and its worker extension, in the vLLM CPU virtualenv. The engine runs with its defaults (the
collective transport over gloo, "bucket" staging) and a 256 KiB bucket, so the model moves in a few groups and
vLLM loads each batch while the next one lands.

1. makes a tiny Qwen3 checkpoint A (transformers) and B, the weights after one "training step" (an elementwise
   function applied here to A's tensors: ground truth independent of reshard);
2. starts the vLLM engine on B and records its greedy tokens and vLLM's own weight checksums;
3. the policy workers, loaded with A, refit the engine (its tokens must change), take the training step (now they
   hold B) and refit again;
4. after each refit prints the train-inference mismatch (reshard.verify: the engine's log-probabilities of a few
   sequences against transformers' on the policy's weights, A then B);
5. exits 0 only if the engine's tokens and weight checksums then equal those it had when started on B, each
   policy worker sent only part of the model and both mismatches are within the float32 thresholds.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]  # this checkout: its reshard is the one every actor imports
ENGINE = "reshard.integrations.nemo_rl:ReshardCheckpointEngine"
PROMPTS = [[1, 2, 3, 4, 5], [17, 40, 3, 99], [64, 65, 66, 7, 7, 7, 7, 80]]


def train_step(t: torch.Tensor, step: int) -> torch.Tensor:
    """The stand-in for an optimizer step (elementwise: the same however a tensor is sharded)."""
    return t * 0.8 + 0.3 * torch.sin(3.0 * t + float(step))


def make_checkpoints(work: Path) -> tuple[Path, Path]:
    """A: a tiny random Qwen3 (every weight N(0, 1), so a misplaced element changes the tokens); B: A after a step."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=120, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, intermediate_size=96, max_position_embeddings=256,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape))
    model.save_pretrained(work / "A")
    model.config.save_pretrained(work / "B")
    trained = {k: train_step(v, 1).contiguous() for k, v in load_file(str(work / "A/model.safetensors")).items()}
    save_file(trained, str(work / "B/model.safetensors"))
    return work / "A", work / "B"


class PolicyWorker:
    """NeMo-RL's policy worker with its checkpoint-engine mixins (PolicyCheckpointEngineMixin,
    MegatronCheckpointEngineSendMixin): Megatron hands the engine whole HF tensors; here they are a checkpoint's."""

    def __init__(self, rank: int, checkpoint: str) -> None:
        from safetensors.torch import load_file

        torch.set_num_threads(1)
        self.rank, self.engine = rank, None
        self.weights = load_file(str(Path(checkpoint) / "model.safetensors"))

    def train(self, step: int) -> None:
        self.weights = {k: train_step(v, step) for k, v in self.weights.items()}

    def _iterator(self) -> Iterator[tuple[str, torch.Tensor]]:
        layout = self.engine.get_target_weight_layout()  # what the Megatron worker filters its iterator with
        for name, tensor in self.weights.items():
            if layout is None or not any(name.startswith(p) for p in layout["missing_weight_prefixes"]):
                yield name, tensor  # (NeMo-RL also filters experts by layout["expert_params"]; None: nothing)

    async def checkpoint_engine_rpc(self, checkpoint_method: str, method_kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = method_kwargs or {}
        if checkpoint_method == "init_checkpoint_engine":
            if self.engine is None:
                module, name = kwargs["backend"].split(":", 1)  # NeMo-RL's create_checkpoint_engine
                cls = getattr(importlib.import_module(module), name)
                self.engine = cls(bucket_size=kwargs["bucket_size_bytes"], **kwargs["engine_kwargs"])
            return None
        if checkpoint_method == "prepare_checkpoint_engine":
            return {**self.engine.prepare(), "rank": self.rank}
        if checkpoint_method == "init_checkpoint_engine_process_group":
            return self.engine.init_policy_process_group(worker_rank=self.rank, **kwargs)
        if checkpoint_method == "send_weights_via_checkpoint_engine":
            await self.engine.send_weights(self._iterator())
            return self.engine.last_refit["bytes_sent"]  # (NeMo-RL returns nothing; printed here)
        if checkpoint_method == "finalize_checkpoint_engine":
            return self.engine.finalize()
        raise ValueError(f"unknown checkpoint method {checkpoint_method!r}")


class Synchronizer:
    """NeMo-RL's CheckpointEngineWeightSynchronizer, in its call order (one vLLM engine: one data-parallel group)."""

    def __init__(self, policy: list, generation: Any, engine_kwargs: dict[str, Any], bucket_size: int) -> None:
        self.policy, self.generation = policy, generation
        self.engine_kwargs, self.bucket_size, self.ready = engine_kwargs, bucket_size, False

    def _policy(self, method: str, **kwargs: Any) -> list:
        return [w.checkpoint_engine_rpc.remote(method, kwargs) for w in self.policy]

    def _generation(self, method: str, args: tuple = ()) -> list:
        return [self.generation.checkpoint_engine_rpc.remote(method, args)]

    def init(self) -> None:
        import ray

        ray.get(self._policy("init_checkpoint_engine", backend=ENGINE, bucket_size_bytes=self.bucket_size,
                             engine_kwargs=self.engine_kwargs)
                + self._generation("init_checkpoint_engine", (ENGINE, self.bucket_size, self.engine_kwargs)))
        results = ray.get(self._policy("prepare_checkpoint_engine") + self._generation("prepare_checkpoint_engine"))
        policy_metadata = sorted(results[:len(self.policy)], key=lambda m: m["rank"])
        generation_metadata = sorted(results[-1], key=lambda m: m["rank"])  # one group: its workers' list
        topology = {"metadata": policy_metadata + generation_metadata, "train_world_size": len(policy_metadata),
                    "rollout_world_size": len(generation_metadata)}
        ray.get(self._policy("init_checkpoint_engine_process_group", **topology)
                + self._generation("init_checkpoint_engine_process_group",
                                   (0, topology["train_world_size"], topology["rollout_world_size"],
                                    topology["metadata"])))
        self.ready = True

    def sync_weights(self) -> list[int]:
        """One refit; the bytes each policy worker sent. Raises if the refit failed."""
        import ray

        if not self.ready:
            self.init()
        refs = self._policy("send_weights_via_checkpoint_engine")
        results = ray.get(refs + self._generation("update_weights_from_checkpoint_engine"))
        if not all(r for r in results[len(refs):] if r is not None):
            raise RuntimeError("weight transfer failed during the checkpoint-engine sync")
        return results[:len(refs)]

    def shutdown(self) -> None:
        import ray

        if self.ready:
            ray.get(self._policy("finalize_checkpoint_engine") + self._generation("finalize_checkpoint_engine"))
            self.ready = False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy-workers", type=int, default=2)
    p.add_argument("--tp", type=int, default=1, help="the vLLM engine's tensor-parallel size")
    p.add_argument("--vllm-python", default=os.environ.get("RESHARD_VLLM_CPU_PYTHON",
                                                          str(ROOT / ".venv-vllm-cpu/bin/python")))
    p.add_argument("--workdir", default=None)
    a = p.parse_args()
    if not Path(a.vllm_python).exists():
        print(f"no vLLM CPU python at {a.vllm_python}: run scripts/bootstrap vllm first", file=sys.stderr)
        return 2
    import ray

    work = Path(a.workdir or tempfile.mkdtemp(prefix="reshard-nemo-rl-"))
    ckpt_a, ckpt_b = make_checkpoints(work)
    path = os.pathsep.join([str(ROOT), str(HERE)])
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu", "PYTHONPATH": path,
           **({"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % (os.cpu_count() or 1)) for i in range(a.tp))}
              if a.tp > 1 else {})}
    t0 = time.perf_counter()
    generation = start_generation(a.vllm_python, str(ckpt_b), a.tp, env)
    policy = [ray.remote(PolicyWorker).options(num_cpus=0).remote(r, str(ckpt_a)) for r in range(a.policy_workers)]
    # the refit_cfg entry as a user writes it: no address (each engine finds its own, here the Ray node's IP)
    sync = Synchronizer(policy, generation, {"model": str(ckpt_a), "release_after_refit": False}, bucket_size=1 << 18)
    ok = False
    try:
        fresh = ray.get(generation.greedy.remote(PROMPTS))
        fresh_sums = ray.get(generation.weight_checksums.remote())
        print(f"vLLM engine (tp={a.tp}) up on B in {time.perf_counter() - t0:.0f} s; "
              f"{a.policy_workers} policy workers hold A")
        t0 = time.perf_counter()
        sync.init()
        print(f"checkpoint engines prepared and joined in {time.perf_counter() - t0:.2f} s")
        sent_a = sync.sync_weights()
        tokens_a = ray.get(generation.greedy.remote(PROMPTS))
        mismatch_a = mismatch(generation, ckpt_a)
        ray.get([w.train.remote(1) for w in policy])
        t0 = time.perf_counter()
        sent_b = sync.sync_weights()
        seconds = time.perf_counter() - t0
        tokens_b = ray.get(generation.greedy.remote(PROMPTS))
        mismatch_b = mismatch(generation, ckpt_b)
        sums_b = ray.get(generation.weight_checksums.remote())
        model_bytes = sum(os.path.getsize(f) for f in ckpt_b.glob("*.safetensors"))
        print(f"refit after the step: {seconds * 1e3:.0f} ms; bytes sent per policy worker {sent_b} "
              f"(the model: about {model_bytes:,} B)")
        checks = {
            "refit with A changed the tokens": tokens_a != fresh,
            "after the step's refit the tokens equal the engine's when started on B": tokens_b == fresh,
            "vLLM's weight checksums equal the engine's when started on B": sums_b == fresh_sums,
            "every policy worker sent a part of the model, none all of it":
                all(0 < s < sum(sent_b) for s in sent_b) if len(sent_b) > 1 else sent_b[0] > 0,
            "both refits sent the same bytes": sent_a == sent_b,
            "the train-inference mismatch after each refit is within the float32 thresholds":
                mismatch_a.ok and mismatch_b.ok,
        }
        for what, good in checks.items():
            print(f"  {'ok  ' if good else 'FAIL'} {what}")
        ok = all(checks.values())
    finally:
        try:
            sync.shutdown()
        finally:
            stop_generation(generation)
            ray.shutdown()
    return 0 if ok else 1


def mismatch(generation: Any, trained: Path) -> Any:
    """The train-inference mismatch after a refit: the engine's scores of a few sequences against transformers'
    on the policy's weights (`trained`, the checkpoint they equal), printed; its MismatchReport."""
    import ray

    from reshard.verify import Scores, checkpoint_scores, compare, random_sequences

    sequences = random_sequences(120, 3, 16)  # the vocabulary of make_checkpoints' model
    rows = ray.get(generation.prompt_logprobs.remote(sequences))
    report = compare(checkpoint_scores(trained, sequences), Scores.of(*zip(*rows)), "float32")
    print(f"after the refit to {trained.name}: {report}")
    return report


def start_generation(python: str, model: str, tp: int, env: dict[str, str]) -> Any:
    """The vLLM engine actor (vllm_side.GenerationActor) in the vLLM virtualenv."""
    import ray

    sys.path.insert(0, str(HERE))
    from vllm_side import GenerationActor

    options = {"num_cpus": 0, "runtime_env": {"py_executable": python, "env_vars": env}}
    return ray.remote(GenerationActor).options(**options).remote(model, tp, env)


def stop_generation(actor: Any) -> None:
    """Stop the engine's processes, then the actor (and any of its processes left, by PID)."""
    import signal

    import ray

    try:
        pids = ray.get(actor.processes.remote(), timeout=60)
        ray.get(actor.shutdown.remote(), timeout=120)
    except Exception:  # noqa: BLE001 - the actor may be gone already
        pids = []
    ray.kill(actor)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    sys.exit(main())
