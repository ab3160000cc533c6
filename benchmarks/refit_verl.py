"""verl refits through reshard's checkpoint engine beside verl's stock pattern, on one CPU harness and one run.

    .venv-verl/bin/python benchmarks/refit_verl.py [--trainers 2] [--rollouts 3] [--bucket-mb 4] [--refits 3]

verl's real CheckpointEngineManager drives every backend between the same trainer workers (verl's
ActorRolloutRefWorker.update_weights over a megatron-core MoE model exported as gathered HF tensors, as verl's
Megatron engine hands them to any backend) and the same rollout workers (verl's CheckpointEngineWorker), over a
local Ray cluster (harness.verl_cpu). Backends, switched between runs without restarting the workers:
- funnel: verl's stock NCCL engine's pattern over gloo (trainer rank 0 broadcasts buckets of whole tensors to
  every rollout rank; the other trainer ranks only drain);
- reshard: whole tensors to every rollout rank, the sending spread over all trainer ranks, all or nothing;
- reshard fanout=1: the trainers send one copy, rollout ranks relay to the others.
Per backend: the trainer ranks' egress (measured by each backend: bytes handed to the transport) beside the
bound no backend can beat (N copies of the model over M ranks, or one copy with fan-out), and the refit's wall
time (the median of `--refits` refits after a warm-up) beside the time of one copy of the model in memory.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import _harness_path  # noqa: E402,F401 - tests/ (the harness) on the path, here and in children
from harness import verl_cpu as vc

MODEL = vc.TinyGPT(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2, head_dim=32,
                   ffn_hidden_size=512, vocab_size=8000, padded_vocab_size=8064, num_experts=8,
                   moe_ffn_hidden_size=256)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--rollouts", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=4)
    parser.add_argument("--refits", type=int, default=3)
    args = parser.parse_args()
    m, n = args.trainers, args.rollouts
    checkpoint = str(vc.save_checkpoint(MODEL, Path(tempfile.mkdtemp()) / "checkpoint"))
    spec = vc.ModelSpec.from_hf_config(checkpoint)
    model_bytes = sum(t.numel * spec.itemsize for t in spec.tensors)
    copy = torch.empty(model_bytes, dtype=torch.uint8)
    start = time.perf_counter()
    copy.clone()
    copy_s = time.perf_counter() - start

    vc.start_ray()
    ce = {"funnel": vc.checkpoint_engine_config(checkpoint, args.bucket_mb, backend="funnel"),
          "reshard": vc.checkpoint_engine_config(checkpoint, args.bucket_mb),
          "reshard fanout=1": vc.checkpoint_engine_config(checkpoint, args.bucket_mb, fanout=1)}
    harness = vc.Refit(m, n, checkpoint, ce["funnel"], tiny=MODEL)
    rows, step = [], 0
    for label, config in ce.items():
        if label != "funnel":
            harness.replace_trainers(config)  # a manager for this backend (same rollout workers)
            harness.rollouts.reconfigure(config)
        times, metrics = [], {}
        for k in range(args.refits + 1):
            step += 1
            harness.trainers.train_step(step)
            start = time.perf_counter()
            metrics = harness.refit(step)
            if k:
                times.append(time.perf_counter() - start)
        expected = harness.expected()
        correct = all(d == expected for _, d in harness.served())
        prefix = "funnel" if label == "funnel" else "reshard"
        egress = [metrics.get(f"{prefix}/trainer{p}/egress_bytes", 0.0) for p in range(m)]
        bound = (model_bytes if "fanout" in label else n * model_bytes) / m
        rows.append((label, egress, bound, statistics.median(times), correct))
    harness.shutdown()

    mib = 2 ** 20
    print(f"model: megatron-core MoE {MODEL.num_layers} layers, {MODEL.num_experts} experts, "
          f"{model_bytes / mib:.1f} MiB (float32); {m} trainer ranks -> {n} rollout ranks; "
          f"bucket {args.bucket_mb} MiB; "
          f"one in-memory copy of the model: {copy_s * 1e3:.1f} ms")
    print(f"{'backend':<18} {'egress per trainer rank (MiB)':<32} {'busiest / bound':>16} {'refit (s)':>10} "
          f"{'correct':>8}")
    for label, egress, bound, seconds, correct in rows:
        print(f"{label:<18} {', '.join(f'{e / mib:.2f}' for e in egress):<32} "
              f"{max(egress) / mib:>6.2f} / {bound / mib:<6.2f} {seconds:>10.3f} {str(correct):>8}")


if __name__ == "__main__":
    main()
