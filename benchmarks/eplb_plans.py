"""Refit plans into EPLB engines (issue 42): compile time, wire bytes and predicted refit time with redundant experts.

    python benchmarks/eplb_plans.py                       # the table (vLLM's EPLB policy where vLLM imports)
    .venv-vllm/bin/python benchmarks/eplb_plans.py        # placements from vLLM's own DefaultEplbPolicy
    python benchmarks/eplb_plans.py --json out.json --repeat 3

Cases: DeepSeek-V3 (256 experts, 58 MoE layers) and Qwen3-235B-A22B (128 experts, 94 MoE layers), bf16, one vLLM
engine at EP32 and EP64 (VllmLayout's expert parallelism: experts whole over the engine's TP ranks) from a Megatron
trainer; per destination, the refit without redundancy beside 10-30% redundant experts (EPLB needs the physical
slots to split evenly over the EP ranks, so the redundancy is a multiple of the EP size: Qwen3-235B at EP64 has
no choice between 0 and 64, i.e. 50%). Placements: vLLM's initial one, and a rebalanced one per MoE layer from
vLLM's `DefaultEplbPolicy.rebalance_experts` on heavy-tailed random loads (hierarchical, nodes of 8 GPUs, where the
model's expert groups allow it; a random permutation with replicas where vLLM does not import: the table says which).

Columns: compile = CPU seconds of `reshard.compile(src, dst, fanout=1)` (best of --repeat; the machine is shared,
CPU time is the figure; fanout=1 on one engine builds no tree, it lets the engine's ranks relay); wire = bytes the
plan moves; +wire = over the same refit without redundancy; egress = what the trainer sends, with every slot fed by
the trainer (`expert_copies=False`) and with the redundant slots fed by the engine (planner.fanout.slot_copies:
the trainer sends each expert once, into the EP rank holding most of its slots; the others copy it from there, on
that rank or over the engine's links); copies = bytes the engine's slot copies move (of them, on one rank);
predicted = the bandwidth model (reshard.planner.cost: 8 GPUs per node, one 400 Gb/s NIC per GPU, 50 GB/s each way,
NVLink inside a node; trainer and engine on different nodes) for each of the two plans.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reshard  # noqa: E402
from reshard.layouts import ExpertPlacement, VllmLayout  # noqa: E402
from reshard.layouts.vllm import moe_layer_numbers  # noqa: E402
from reshard.planner.cost import ClusterModel, predict  # noqa: E402

MODELS = {
    "DeepSeek-V3": ("examples/configs/deepseek-v3.json",
                    "megatron:tp=1,pp=16,ep=16,etp=1,world=256,first_stage_layers=3,last_stage_layers=2", 8),
    "Qwen3-235B-A22B": ("examples/configs/qwen3-235b-a22b.json",
                        "megatron:tp=4,pp=8,ep=16,etp=1,world=128,first_stage_layers=11,last_stage_layers=11", 1),
}  # name -> (config, trainer layout, expert groups: DeepSeek's n_group, for vLLM's hierarchical policy)
EP_SIZES = (32, 64)
GPUS_PER_NODE = 8


def redundancies(E: int, ep: int) -> list[int]:
    """0, then the multiples of `ep` between 10% and 30% of E (the smallest above 0 if none is)."""
    steps = [k * ep for k in range(1, E // ep + 2)]
    chosen = [r for r in steps if 0.10 * E <= r <= 0.30 * E] or steps[:1]
    return [0, *chosen]


def rebalanced(spec: reshard.ModelSpec, redundant: int, ep: int, groups: int, seed: int) -> tuple[ExpertPlacement, str]:
    """A placement per MoE layer after a rebalance: vLLM's policy when it imports, else random (named which)."""
    E, layers = spec.num_experts, len(moe_layer_numbers(spec))
    rng = np.random.default_rng(seed)
    loads = (rng.gamma(0.5, size=(layers, E)) * 1000).astype(np.int64) + 1  # heavy-tailed expert loads
    try:
        import torch
        from vllm.distributed.eplb.policy.default import DefaultEplbPolicy
    except ImportError:
        rows = [rng.permutation(np.concatenate([np.arange(E), rng.integers(0, E, redundant)])) for _ in range(layers)]
        return ExpertPlacement.from_vllm(np.stack(rows), ranks=ep, logical_experts=E), "random"
    nodes = max(1, ep // GPUS_PER_NODE)
    p2l = DefaultEplbPolicy.rebalance_experts(torch.from_numpy(loads), E + redundant, groups, nodes, ep)
    kind = "vLLM policy, hierarchical" if groups % nodes == 0 else "vLLM policy, global"
    return ExpertPlacement.from_vllm(p2l, ranks=ep, logical_experts=E), kind


def run_case(name: str, ep: int, redundant: int, placement: str, repeat: int) -> dict:
    config, src_text, groups = MODELS[name]
    spec = reshard.ModelSpec.from_hf_config(ROOT / config)
    src = reshard.parse_layout(src_text, spec)
    kind, explicit = "initial", None
    if placement == "rebalanced":
        explicit, kind = rebalanced(spec, redundant, ep, groups, seed=ep + redundant)
    dst = VllmLayout(model=spec, tp=ep, expert_parallel=True, redundant_experts=redundant, expert_placement=explicit)
    reshard.compile(src, dst, layers=[moe_layer_numbers(spec)[0]])  # warm the placement caches of the layouts
    cpu, wall, plan = [], [], None
    for _ in range(repeat):  # fanout=1: one engine, so no tree; it lets the engine's ranks relay the slot copies
        plan = None
        t, w = time.process_time(), time.perf_counter()
        plan = reshard.compile(src, dst, fanout=1)
        cpu.append(time.process_time() - t)
        wall.append(time.perf_counter() - w)
    every = reshard.compile(src, dst, fanout=1, expert_copies=False)  # the trainer feeds every slot
    cluster = ClusterModel()
    a, b = plan.accounting, every.accounting
    slot_bytes = 3 * spec.hidden_size * spec.moe_intermediate_size * spec.itemsize
    return {"model": name, "ep": ep, "redundant": redundant, "redundant_pct": 100 * redundant / spec.num_experts,
            "placement": kind if redundant or explicit else "linear (no EPLB)", "src": str(src), "dst": str(dst),
            "compile_cpu_s": min(cpu), "compile_wall_s": min(wall), "ops": a.num_ops, "wire_bytes": a.total_bytes,
            "egress_bytes": sum(a.egress_bytes), "egress_every_slot_bytes": sum(b.egress_bytes),
            "slot_copy_bytes": a.slot_copy_bytes, "slot_copy_local_bytes": a.slot_copy_local_bytes,
            "max_ingress_bytes": a.max_ingress, "replica_bytes": redundant * len(moe_layer_numbers(spec)) * slot_bytes,
            "predicted_s": predict(plan, cluster).seconds, "predicted_every_slot_s": predict(every, cluster).seconds,
            "busiest": str(predict(plan, cluster).busiest), "coverage": plan.coverage}


def table(rows: list[dict]) -> str:
    head = ["model", "EP", "redundant", "placement", "compile s", "ops", "wire GB", "+wire", "egress GB every slot",
            "egress GB slot copies", "copies GB (on rank)", "predicted s every slot", "predicted s slot copies"]
    out = [head]
    base = {}
    for r in rows:
        if r["redundant"] == 0:
            base[(r["model"], r["ep"])] = r
        b = base[(r["model"], r["ep"])]
        out.append([r["model"], str(r["ep"]), f"{r['redundant']} ({r['redundant_pct']:.1f}%)", r["placement"],
                    f"{r['compile_cpu_s']:.2f}", f"{r['ops']:,}", f"{r['wire_bytes'] / 1e9:,.1f}",
                    f"{100 * (r['wire_bytes'] / b['wire_bytes'] - 1):+.1f}%",
                    f"{r['egress_every_slot_bytes'] / 1e9:,.1f}", f"{r['egress_bytes'] / 1e9:,.1f}",
                    f"{r['slot_copy_bytes'] / 1e9:.1f} ({r['slot_copy_local_bytes'] / 1e9:.1f})",
                    f"{r['predicted_every_slot_s']:.3f}", f"{r['predicted_s']:.3f}"])
    widths = [max(len(row[i]) for row in out) for i in range(len(head))]
    lines = [" | ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in out]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=2, help="compiles per case (the best CPU time is reported)")
    p.add_argument("--model", action="append", choices=sorted(MODELS), help="only these models")
    p.add_argument("--json", type=Path, help="also write the rows as JSON")
    a = p.parse_args(argv)
    rows = []
    for name in a.model or list(MODELS):
        spec = reshard.ModelSpec.from_hf_config(ROOT / MODELS[name][0])
        for ep in EP_SIZES:
            for redundant in redundancies(spec.num_experts, ep):
                for placement in (("initial",) if redundant == 0 else ("initial", "rebalanced")):
                    rows.append(run_case(name, ep, redundant, placement, a.repeat))
                    print(f"  {name} EP{ep} +{redundant} {placement}: compile {rows[-1]['compile_cpu_s']:.2f} s",
                          file=sys.stderr, flush=True)
    print(f"machine: {platform.node()} ({platform.machine()}, Python {platform.python_version()}); "
          f"numpy {np.__version__}")
    print(table(rows))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
