"""Real megatron-core distributed checkpoints (`torch_dist`) on CPU, for tests, examples and benchmarks.

`save_job` runs on every gloo rank (through megatron_cpu.run_ranks): it builds the tiny GPT of `tiny` at the
given parallel sizes and saves it with megatron-core's own `dist_checkpointing.save`, keyed like Megatron-LM
(`model`, or `model0`, `model1`, ... with virtual pipeline chunks). Rank 0 also writes the model's weights as HF
safetensors (megatron-core's TP=1 weights of the same seed for dense models), the reference a reader must
reproduce: with `use_cpu_initialization` and one seed the weights do not depend on TP or PP.
"""
from __future__ import annotations

from typing import Any

import torch

from .megatron_cpu import TinyGPT, build_model, init_parallel


def save_job(tiny: TinyGPT, sizes: dict[str, Any], path: str) -> None:
    """Build `tiny` at `sizes` (tp, pp, ep, etp, vpp) on this rank and save it into `path` (an existing, empty
    directory) with megatron-core's dist_checkpointing.save, torch_dist format."""
    import queue

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # The writer collects its results through a multiprocessing Manager queue, which a daemonic test rank cannot
    # start; a synchronous save writes in this process, so an in-process queue carries the same results.
    filesystem_async._results_queue = queue.Queue()
    torch.cuda.synchronize = lambda *a, **k: None  # the writer syncs the GPU after its device-to-host copies
    init_parallel(**sizes)
    chunks = build_model(tiny)
    if len(chunks) == 1:
        state = {"model": chunks[0].sharded_state_dict()}
    else:
        state = {f"model{c}": chunk.sharded_state_dict() for c, chunk in enumerate(chunks)}
    dist_checkpointing.save(state, path)
