"""Predicted refit times from the bandwidth model (reshard.planner.cost): plans past this machine.

    python benchmarks/predict_cluster.py            # the 1T scenario, 235B and 30B on 8-GPU nodes, 400 Gb/s NICs
    python benchmarks/predict_cluster.py --two-gpu  # the 2-GPU refits of benchmarks/refit_nccl.py (issue 3)

Cluster model: 8 GPUs per node, one 400 Gb/s NIC per GPU (50 GB/s each way), NVLink and device copies at the figures
measured on the H200 machine (366 GB/s one way, 676 GB/s both ways, 4.2 TB/s read+write). Source ranks fill
nodes first, destination ranks the nodes after them (trainer and inference on different nodes).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reshard  # noqa: E402
from reshard.planner.cost import ClusterModel, format_prediction, predict  # noqa: E402

CLUSTER = {
    "1t": ("examples/configs/moe-1t.json",
           "megatron:tp=8,pp=8,ep=64,etp=1,world=1024,first_stage_layers=7,last_stage_layers=6",
           "vllm:tp=16,replicas=16"),
    "235b": ("examples/configs/qwen3-235b-a22b.json",
             "megatron:tp=4,pp=8,ep=16,etp=1,world=128,first_stage_layers=11,last_stage_layers=11",
             "vllm:tp=8,replicas=8"),
    "30b": ("examples/configs/qwen3-30b-a3b.json", "megatron:tp=2,pp=2,ep=8,etp=1,world=16",
            "vllm:tp=2,replicas=8"),
}


def cluster(cases: list[str]) -> None:
    cluster = ClusterModel()
    for case in cases:
        config, s, d = CLUSTER[case]
        for dtype in ("bfloat16", "float8_e4m3fn"):
            model = reshard.ModelSpec.from_hf_config(ROOT / config)
            model = model.model_copy(update={"dtype": dtype})
            src, dst = reshard.parse_layout(s, model), reshard.parse_layout(d, model)
            for label, kw, pipelined in (("direct: the source feeds every replica", {}, False),
                                         ("fan-out 2, split trees, pipelined", {"fanout": 2}, True)):
                plan = reshard.compile(src, dst, **kw)
                pred = predict(plan, replace(cluster, pipelined=pipelined))
                a = plan.accounting
                per_gpu = max(a.ingress_bytes)
                floor = per_gpu / cluster.network_bandwidth
                print(f"{case} {dtype} | {label}")
                print(f"  {src} -> {dst}")
                print(f"  trainer egress {sum(a.egress_bytes) / 1e12:.2f} TB (busiest trainer GPU "
                      f"{a.max_egress / 1e9:.1f} GB), roots {plan.roots or dst.num_replicas}, "
                      f"destination ingress {per_gpu / 1e9:.1f} GB per GPU: NIC floor {floor:.3f} s")
                print(format_prediction(pred))
                print()


def two_gpu() -> None:
    """The cases of benchmarks/refit_nccl.py: process p = GPU p; Qwen3-8B shape, bf16."""
    spec = reshard.ModelSpec.from_hf_config(ROOT / "examples/configs/qwen3-8b.json")
    M, V = reshard.MegatronLayout, reshard.VllmLayout
    cases = {
        "E1 TP1 GPU0 -> TP1 GPU1": (reshard.compile(M(model=spec), V(model=spec)), (0,), (1,)),
        "E2 TP2 GPU0+1 -> TP1 GPU1": (reshard.compile(M(model=spec, tp=2), V(model=spec)), (0, 1), (1,)),
        "E3 TP2 GPU0+1 -> TP1 on each GPU": (reshard.compile(M(model=spec, tp=2), V(model=spec, replicas=2),
                                                             colocated=True), (0, 1), (0, 1)),
        "E4 TP1 -> TP1 on one GPU": (reshard.compile(M(model=spec), V(model=spec), colocated=True), (0,), (0,)),
    }
    for name, (plan, src_gpus, dst_gpus) in cases.items():
        base = ClusterModel(src_gpus=src_gpus, dst_gpus=dst_gpus)
        print(f"{name}: {plan.accounting.total_bytes / 1e9:.2f} GB")
        for label, cluster in (("in place, no wire buffers", base),
                               ("in place, pack/unpack wire buffers", replace(base, pack_copies=1)),
                               ("staged commit + wire buffers", replace(base, pack_copies=1, commit_copies=1))):
            pred = predict(plan, cluster)
            print(f"  {label:38s} {pred.seconds * 1e3:8.2f} ms   busiest {pred.busiest}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=sorted(CLUSTER), action="append")
    p.add_argument("--two-gpu", action="store_true")
    args = p.parse_args()
    if args.two_gpu:
        two_gpu()
    else:
        cluster(args.case or ["1t"])


if __name__ == "__main__":
    main()
