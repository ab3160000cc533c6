"""Megatron-Bridge's per-expert adapters on a live megatron-core MoE GPTModel (SequentialMLP, gloo ranks): the job
the expert case of tests/integration/megatron/test_lora_bridge.py runs on each rank."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .lora import attach_bridge_adapters, global_value, refit_into_peft

EXPERT_STRIDE = 16  # expert_value keys: global_value's layer is 1 + EXPERT_STRIDE * layer + expert


def expert_value(layer: int, expert: int, target: str, which: str, row: int, col: int) -> float:
    """The value expert `expert`'s adapter weight holds at (row, col) of its global tensor: distinct for every
    expert, tensor and element, exact in float32."""
    return global_value(1 + EXPERT_STRIDE * layer + expert, target, which, row, col)


def bridge_expert_refit_job(tp: int, ep: int, etp: int, experts: int, out: str, rank: int) -> None:
    """A TinyGPT MoE at (tp, ep, etp) with Bridge-shaped adapters of rank `rank` on every local expert's linear_fc1 /
    linear_fc2, each shard filled by `expert_value` at the global expert megatron-core's EP rank gives local expert
    j and at the offset its expert-TP rank gives the shard. Writes each adapter parameter's local shape, global
    expert and offset to `out/rank<r>.json`; refits from views of the live parameters over gloo into a PEFT layout
    on rank 0, saved to `out/peft.safetensors`."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import reshard
    from reshard.layouts.lora import lora_spec

    from reshard.testing.megatron_cpu import TinyGPT, build_model, init_parallel

    init_parallel(tp=tp, ep=ep, etp=etp)
    tiny = TinyGPT(num_layers=2, num_experts=experts)
    chunks = build_model(tiny)
    attach_bridge_adapters(chunks, rank, targets=("linear_fc1", "linear_fc2"))
    first = ps.get_expert_model_parallel_rank() * (experts // ps.get_expert_model_parallel_world_size())
    t = ps.get_expert_tensor_parallel_rank()
    report = {}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if ".adapter." not in name:
                continue
            parts = name.split(".")
            layer, target, which = int(parts[parts.index("layers") + 1]), parts[-4], parts[-2].split("_")[1]
            e = first + int(parts[parts.index("local_experts") + 1])
            # ColumnParallelLinear weights are cut on rows over expert TP, RowParallelLinear's (fc2's A) on columns
            n0, n1 = p.shape
            o0, o1 = (0, t * n1) if (target, which) == ("linear_fc2", "in") else (t * n0, 0)
            with torch.no_grad():
                for a in range(n0):
                    for b in range(n1):
                        p[a, b] = expert_value(layer, e, target, which, o0 + a, o1 + b)
            report[name] = {"local": list(p.shape), "expert": e, "offset": [o0, o1]}
    me = dist.get_rank()
    Path(out, f"rank{me}.json").write_text(json.dumps(report))
    spec = lora_spec(tiny.spec(), rank, 16, ["linear_fc1", "linear_fc2"])
    refit_into_peft(chunks, reshard.MegatronLayout(model=spec, tp=tp, ep=ep, etp=etp), out)
