"""A refit of real vLLM model code on CPU straight from megatron-core torch_dist checkpoints, against vLLM's own
`load_weights` of the HF export of the same weights (megatron-core's loader + reshard's live adapter, written by
harness.megatron_ckpt in the core virtualenv), byte for byte per parameter. For test_vllm_checkpoint.py;
world_checks.py runs `run_case` in each vLLM TP rank's process of the session's world; each rank is also one
reader of the checkpoint and reads only its part. A case's report: "ok" or what failed, and the bytes read.

A case: {"name", "dir"}   (the dir holds ckpt/ and ref/)
"""
from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import vllm_harness as harness  # noqa: E402
import reshard  # noqa: E402
from rank_checks import poison, same_bytes, snapshot  # noqa: E402
from reshard.adapters.megatron.checkpoint import open_checkpoint  # noqa: E402
from reshard.adapters.megatron.checkpoint_layout import checkpoint_layout, checkpoint_tensors  # noqa: E402
from reshard.adapters.vllm import bind_direct  # noqa: E402
from reshard.executors import make_executor  # noqa: E402
from reshard.executors.binding import Binding  # noqa: E402


def run_case(case: dict, rank: int, world: int) -> dict:
    import torch.distributed as dist
    from vllm.config import set_current_vllm_config

    case = Path(case["dir"])
    ref = case / "ref"
    cfg = harness.engine_config(ref, world, dtype="float32")
    model = harness.build_model(cfg)
    spec = reshard.ModelSpec(**{**reshard.ModelSpec.from_hf_config(str(ref)).model_dump(), "dtype": "float32"})
    hf = {k.removeprefix(""): v for k, v in harness.load_checkpoint(ref).items()}
    poison(model)
    with set_current_vllm_config(cfg):
        model.load_weights(iter([(k, v.clone()) for k, v in hf.items()]))
    truth = snapshot(model)

    poison(model)
    ckpt = open_checkpoint(case / "ckpt")
    src = checkpoint_layout(ckpt, spec, readers=world)  # every vLLM rank is one reader
    dst = reshard.VllmLayout(model=spec, tp=world)
    plan = reshard.compile_plan(src, dst)
    binding = bind_direct(model, dst, rank, None, cfg)
    executor = make_executor("collective", plan, Binding(tuple(range(world)), tuple(range(world))), rank,
                             {rank: checkpoint_tensors(ckpt, plan, rank)}, {rank: binding.tensors},
                             group=dist.group.WORLD, timeout=120.0)
    executor.refit()
    executor.close()
    binding.finish()
    bad = same_bytes(model, truth)
    return {"result": "ok" if not bad else f"FAIL: {bad[:5]}", "bytes_read": ckpt.bytes_read,
            "checkpoint_bytes": ckpt.record_bytes}

