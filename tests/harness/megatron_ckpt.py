"""Real megatron-core distributed checkpoints (`torch_dist`) on CPU, for tests, examples and benchmarks.

`save_job` runs on every gloo rank (through megatron_cpu.run_ranks): it builds the tiny GPT of `tiny` at the
given parallel sizes and saves it with megatron-core's own `dist_checkpointing.save`, keyed like Megatron-LM
(`model`, or `model0`, `model1`, ... with virtual pipeline chunks). Rank 0 also writes the model's weights as HF
safetensors (megatron-core's TP=1 weights of the same seed for dense models), the reference a reader must
reproduce: with `use_cpu_initialization` and one seed the weights do not depend on TP or PP.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from reshard.testing.megatron_cpu import TinyGPT, build_model, init_parallel


def save_job(tiny: TinyGPT, sizes: dict[str, Any], path: str) -> None:
    """Build `tiny` at `sizes` (tp, pp, ep, etp, vpp) on this rank and save it into `path` (an existing, empty
    directory) with megatron-core's dist_checkpointing.save, torch_dist format."""
    init_parallel(**sizes)
    save_chunks(build_model(tiny), path)


def save_chunks(chunks: list, path: str) -> None:
    """On every gloo rank: save this rank's live model chunks into `path` with megatron-core's
    dist_checkpointing.save (torch_dist), keyed like Megatron-LM."""
    import queue

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # The writer collects its results through a multiprocessing Manager queue, which a daemonic test rank cannot
    # start; a synchronous save writes in this process, so an in-process queue carries the same results.
    filesystem_async._results_queue = queue.Queue()
    torch.cuda.synchronize = lambda *a, **k: None  # the writer syncs the GPU after its device-to-host copies
    if len(chunks) == 1:
        state = {"model": chunks[0].sharded_state_dict()}
    else:
        state = {f"model{c}": chunk.sharded_state_dict() for c, chunk in enumerate(chunks)}
    dist_checkpointing.save(state, path)


def reference_job(tiny: TinyGPT, path: str, out: str) -> None:
    """The independent reference (one gloo rank): megatron-core's own loader reads the checkpoint into a TP=1 model
    built from another seed, and reshard's live-model adapter refits that model into HF tensors, saved to
    `out/reference.safetensors` with the HF config beside them."""
    from megatron.core import dist_checkpointing
    from safetensors.torch import save_file

    from reshard.adapters.megatron import derive_layout, source_tensors
    from reshard.executors.reference import allocate, execute_local
    from reshard.layouts import HfLayout
    from reshard.planner import compile_plan

    init_parallel()
    chunks = build_model(replace(tiny, seed=tiny.seed + 1, first_stage_layers=None))
    loaded = dist_checkpointing.load({"model": chunks[0].sharded_state_dict()}, path)
    chunks[0].load_state_dict(loaded["model"], strict=False)  # TransformerEngine _extra_state: none on CPU
    spec = tiny.spec()
    layout = derive_layout(chunks, spec)
    dst = HfLayout(model=spec)
    hf = allocate(dst)
    execute_local(compile_plan(layout, dst), {0: source_tensors(chunks, layout)}, hf)
    save_file(hf[0], f"{out}/reference.safetensors")
    config = tiny.hf_config()
    config.architectures = ["Qwen3MoeForCausalLM" if tiny.num_experts else "Qwen3ForCausalLM"]
    config.save_pretrained(out)


def reader_job(path: str, config: str, out: str, dtype: str) -> None:
    """One reader process of a refit from a checkpoint (gloo, world = readers): reads its part of the plan into
    an HF layout on rank 0 over torch.distributed; rank 0 saves `out/readers.safetensors`; every rank writes what it
    read to `out/reader<r>.json`."""
    import json
    from pathlib import Path

    import torch.distributed as dist
    from safetensors.torch import save_file

    from reshard.adapters.megatron.checkpoint import open_checkpoint
    from reshard.adapters.megatron import read_checkpoint
    from reshard.executors import allocate
    from reshard.layouts import HfLayout, ModelSpec

    me = dist.get_rank()
    spec = ModelSpec(**{**ModelSpec.from_hf_config(f"{config}/config.json").model_dump(), "dtype": dtype})
    ckpt = open_checkpoint(path)
    dst = HfLayout(model=spec)
    out_tensors = {0: allocate(dst)[0]} if me == 0 else {}  # destination rank 0 lives in reader process 0
    read_checkpoint(ckpt, spec, dst, out_tensors)  # every reader process: its part, by byte range
    Path(out, f"reader{me}.json").write_text(json.dumps({"bytes_read": ckpt.bytes_read,
                                                         "chunks_read": ckpt.chunks_read}))
    if me == 0:
        save_file(out_tensors[0], f"{out}/readers.safetensors")


def peft_reader_job(path: str, spec_json: str, out: str) -> None:
    """One reader process of a PEFT directory straight from a checkpoint holding a LoRA adapter (gloo, world =
    readers; `spec_json` the adapter's lora_spec as JSON): each reads its part of the plan into the PEFT layout on
    rank 0 over torch.distributed; rank 0 publishes it at `out/peft` through PeftDirectory; every rank writes
    what it read to `out/reader<r>.json`."""
    import json
    from pathlib import Path

    import torch.distributed as dist

    from reshard.adapters.lora import PeftDirectory
    from reshard.adapters.megatron import read_checkpoint
    from reshard.layouts import ModelSpec
    from reshard.layouts.lora import PeftLayout

    me = dist.get_rank()
    spec = ModelSpec.model_validate_json(spec_json)
    directory = PeftDirectory(Path(out, "peft"), PeftLayout(model=spec)) if me == 0 else None
    read = read_checkpoint(path, spec, PeftLayout(model=spec), {0: directory.tensors} if directory else {})
    Path(out, f"reader{me}.json").write_text(json.dumps({"bytes_read": read.bytes_read}))
    if directory is not None:
        directory.publish("checkpoint")


CASES: dict[str, tuple[TinyGPT, int, dict[str, int]]] = {  # name -> (model, world, parallel sizes) of saved cases
    "dense_tp2": (TinyGPT(), 2, {"tp": 2}),
    "dense_pp2_vpp2_tied": (TinyGPT(tied=True), 2, {"pp": 2, "vpp": 2}),
    "moe_tp2_ep2_etp2": (TinyGPT(num_experts=4), 4, {"tp": 2, "ep": 2, "etp": 2}),
}


def save_case(name: str, out: str) -> None:
    """Save case `name` into `out/ckpt` and its megatron-loader reference into `out/ref` (HF config and
    reference.safetensors): what the vLLM stage, which has no megatron-core, compares against."""
    import tempfile
    from pathlib import Path

    from reshard.testing.megatron_cpu import run_ranks

    tiny, world, sizes = CASES[name]
    ckpt, ref = Path(out, "ckpt"), Path(out, "ref")
    ckpt.mkdir(parents=True)
    ref.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as errdir:
        run_ranks(world, save_job, tiny, sizes, str(ckpt), errdir=errdir, timeout=300)
        run_ranks(1, reference_job, tiny, str(ckpt), str(ref), errdir=errdir, timeout=300)


if __name__ == "__main__":  # python -m harness.megatron_ckpt OUT CASE...
    import sys

    for case_name in sys.argv[2:]:
        save_case(case_name, f"{sys.argv[1]}/{case_name}")
