"""Trainer workers and vLLM engines as Ray actors (the NeMo-RL shape): a GRPO-like loop of generate, train,
refit every engine, generate again, for a few steps.

    .venv/bin/python examples/nemo_rl/refit.py [--steps 3] [--trainer-tp 2] [--replicas 2]

- a local Ray cluster (bounded CPUs); trainer actors run megatron-core (TP2 on gloo) in this virtualenv, which
  has no vLLM; engine actors run vLLM CPU engines in the vLLM virtualenv (`runtime_env={"py_executable": ...}`):
  `--replicas` TP1 replicas refit as one group with fan-out (one replica relays to the next, so the trainers send
  one copy of the model however many replicas there are), and one TP2 engine as a group of its own;
- every step: the engines generate, the trainers take a training step (a deterministic elementwise function of
  their weights), every group is refit (`TrainerSession` on each trainer actor; trainer actor 0 drives the
  engines through `RayEngineClient`), the engines generate again;
- ground truth: a fresh engine started from the step's weights, saved as an HF checkpoint computed here from the
  first checkpoint by the same function (independent of Megatron and of reshard); exits non-zero on any token
  or weight-version mismatch.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = [[1, 2, 3, 4, 5], [17, 40, 3, 99], [64, 65, 66, 7, 7, 7, 7, 80]]


def main() -> int:
    import ray

    from reshard.adapters.ray import RayEngineClient
    from reshard.testing.megatron_cpu import TinyGPT
    from reshard.testing.ray_jobs import (open_group, reference_tokens, refit_all, start_engine, start_trainers,
                                          stop_engine)
    from reshard.testing.serve import vllm_cpu_python
    from reshard.testing.serve_jobs import load_checkpoint, make_checkpoint, save_checkpoint, train_step

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--trainer-tp", type=int, default=2)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--transport", default="collective", choices=["collective", "nixl"])
    p.add_argument("--workdir", default=None)
    a = p.parse_args()
    if vllm_cpu_python() is None:
        print("no vLLM CPU virtualenv: run scripts/bootstrap vllm first", file=sys.stderr)
        return 2
    work = Path(a.workdir or tempfile.mkdtemp(prefix="reshard-nemo-rl-"))
    ckpts = [make_checkpoint(TinyGPT(), work / "step-0")]
    for step in range(1, a.steps + 1):  # what the trainer holds after each step, computed independently
        prev = load_checkpoint(ckpts[-1])
        trained = {k: train_step(v, step) for k, v in prev.items()}
        ckpts.append(save_checkpoint(trained, ckpts[0], work / f"step-{step}"))
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    t0 = time.perf_counter()
    replicas = [start_engine(str(ckpts[0]), 1) for _ in range(a.replicas)]
    tp2 = start_engine(str(ckpts[0]), 2)
    trainers = start_trainers(a.trainer_tp, {"tp": a.trainer_tp, "checkpoint": str(ckpts[0])})
    clients = {f"replica {k}": RayEngineClient(e, f"replica {k}") for k, e in enumerate(replicas)}
    clients["tp2"] = RayEngineClient(tp2, "tp2")
    ok = True
    try:
        for c in clients.values():
            c.greedy(PROMPTS[:1])  # engines are up
        print(f"{len(replicas)} TP1 replicas, one TP2 engine and {a.trainer_tp} trainer actors up in "
              f"{time.perf_counter() - t0:.0f} s")
        open_group(trainers, {"name": "replicas", "dst": {"tp": 1, "replicas": a.replicas}, "fanout": 1,
                              "transport": a.transport}, replicas)
        open_group(trainers, {"name": "tp2", "dst": {"tp": 2}, "fanout": 1, "transport": a.transport}, [tp2])
        for step in range(1, a.steps + 1):
            rollouts = {name: c.greedy(PROMPTS) for name, c in clients.items()}  # generate
            ray.get([t.train_step.remote(step) for t in trainers])  # train
            results = refit_all(trainers, f"step-{step}")  # refit every engine
            want = reference_tokens(str(ckpts[step]), PROMPTS)
            line = []
            for group in ("replicas", "tp2"):
                r = [x[group] for x in results]
                if not all(x["ok"] for x in r):
                    print(f"  step {step} {group}: refit failed: {[x.get('error') for x in r]}")
                    ok = False
                    continue
                sent = sum(x["bytes_sent"] for x in r)
                line.append(f"{group} {max(x['seconds'] for x in r) * 1e3:.0f} ms, trainer egress {sent:,} B")
            for name, c in clients.items():
                got, version = c.greedy(PROMPTS), c.weight_version()
                good = got == want and version == f"step-{step}" and got != rollouts[name]
                ok &= good
                if not good:
                    print(f"  step {step} {name}: tokens {'match' if got == want else 'DIFFER'}, version {version!r}")
            print(f"step {step}: {'; '.join(line)}; every engine's tokens equal a fresh engine's: "
                  f"{all(c.greedy(PROMPTS) == want for c in clients.values())}")
        model_bytes = sum(v.numel() * v.element_size() for v in load_checkpoint(ckpts[0]).values())
        print(f"one copy of the model: {model_bytes:,} B (the trainers' egress to {a.replicas} replicas with fan-out)")
    finally:
        for e in [*replicas, tp2]:
            stop_engine(e)
        ray.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
