"""Issue 8 on CPU: the eight-GPU Qwen3-30B-A3B refit plans, their accounting and predicted times.

The GPU run of issue 8 needs the eight-GPU machine, which is withheld; this script does the part a CPU can:
compile each move, account the bytes that cross GPUs and the busiest GPU's egress and ingress (trainer and
vLLM ranks colocated: trainer rank g and vLLM rank g share GPU g), with fan-out trees on and off, and print the
bandwidth model's prediction (one 8-GPU NVLink node, figures measured on the H200 machines) beside the
gather-then-broadcast byte count.

    python benchmarks/moe_8gpu_plans.py
"""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reshard  # noqa: E402
from reshard.errors import LayoutError  # noqa: E402
from reshard.planner import predict  # noqa: E402
from reshard.planner.cost import ClusterModel  # noqa: E402

SRC = "megatron:tp=2,ep=4,etp=1,world=8"
MOVES = {
    "(a) vLLM TP2 x 4 replicas, colocated": "vllm:tp=2,replicas=4",
    "(b) vLLM TP8, one replica, colocated": "vllm:tp=8",
    "(c) vLLM TP1 with expert parallel 8": None,  # DP-attention + EP across engines: not a layout reshard has
}


def main() -> None:
    spec = reshard.ModelSpec.from_hf_config(ROOT / "examples/configs/qwen3-30b-a3b.json")
    src = reshard.parse_layout(SRC, spec)
    where = ClusterModel(gpus_per_node=8, src_gpus=tuple(range(8)), dst_gpus=tuple(range(8)))
    print(f"model {spec}\nsource {src}\n")
    print("move | fan-out | ops | compile s | cross-GPU GB | busiest trainer egress GB | busiest GPU egress GB "
          "(trainer + relays) | busiest ingress GB | predicted ms | busiest resource | gather-broadcast GB")
    for label, dst_text in MOVES.items():
        if dst_text is None:
            print(f"{label} | - | not planned: vLLM's TP1 + EP8 spreads experts over 8 data-parallel engines, "
                  "which VllmLayout does not describe yet")
            continue
        try:
            dst = reshard.parse_layout(dst_text, spec)
        except LayoutError as exc:
            print(f"{label} | refused: {exc}")
            continue
        for fanout, roots in ((None, None), (2, None), (2, 1)):
            if fanout and dst.num_replicas == 1:
                continue
            t0 = time.process_time()
            plan = reshard.compile(src, dst, colocated=True, fanout=fanout, roots=roots)
            seconds = time.process_time() - t0
            a = plan.accounting
            egress = [a.egress_bytes[g] + (a.relay_egress_bytes[g] if g < len(a.relay_egress_bytes) else 0)
                      for g in range(8)]
            busiest = max(range(8), key=lambda g: egress[g])
            pred = predict(plan, dataclasses.replace(where, pipelined=bool(fanout)))
            mode = f"{fanout}, roots {roots or 'default'}" if fanout else "off"
            print(f"{label} | {mode} | {a.num_ops:,} | {seconds:.2f} | {a.cross_bytes / 1e9:.2f} | "
                  f"{a.max_egress / 1e9:.2f} | {egress[busiest] / 1e9:.2f} (GPU {busiest}) | {a.max_ingress / 1e9:.2f} | "
                  f"{pred.seconds * 1e3:.1f} | {pred.busiest} | {a.gather_broadcast_bytes / 1e9:.1f}")


if __name__ == "__main__":
    main()
