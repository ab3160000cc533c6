"""Refits straight from a megatron-core torch_dist checkpoint: into an HF directory, its LoRA adapter into a PEFT
directory, or from several reader processes into any destination an executor reaches (`read_checkpoint`). No
model is built: each reader reads, by byte range, only the rows its part of the plan sends.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import ArgumentError
from ...layouts import HfLayout, Layout, ModelSpec
from .checkpoint import Checkpoint, open_checkpoint
from .checkpoint_layout import checkpoint_layout, checkpoint_tensors


@dataclass(frozen=True)
class CheckpointRefit:
    """What one refit from a checkpoint read and wrote."""
    bytes_read: int  # from the shard files, torch.save framing included
    bytes_written: int  # tensor data written into the destination
    checkpoint_bytes: int  # every tensor record of the checkpoint
    seconds: float


def export_hf(checkpoint: str | os.PathLike[str] | Checkpoint, config: str | os.PathLike[str],
              out: str | os.PathLike[str], *, dtype: str | None = None) -> CheckpointRefit:
    """Write the HF directory of `checkpoint` (model.safetensors, `config`'s JSON) into `out` (new or empty)."""
    from safetensors.torch import save_file

    from ...executors.reference import allocate, execute_local
    from ...planner import compile_plan

    start = time.perf_counter()
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint)
    config_file = Path(config) / "config.json" if Path(config).is_dir() else Path(config)
    spec = ModelSpec.from_hf_config(str(config_file))
    if dtype is not None:
        spec = ModelSpec(**{**spec.model_dump(), "dtype": dtype})
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ArgumentError("out", str(target), "must be a new or empty directory")
    before = ckpt.bytes_read
    src = checkpoint_layout(ckpt, spec)
    dst = HfLayout(model=spec)
    plan = compile_plan(src, dst)
    hf = allocate(dst)
    execute_local(plan, {0: checkpoint_tensors(ckpt, plan, 0)}, hf)
    target.mkdir(parents=True, exist_ok=True)
    save_file(hf[0], str(target / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(config_file, target / "config.json")
    written = sum(t.numel() * t.element_size() for t in hf[0].values())
    return CheckpointRefit(ckpt.bytes_read - before, written, ckpt.record_bytes, time.perf_counter() - start)


def export_peft(checkpoint: str | os.PathLike[str] | Checkpoint, spec: ModelSpec, out: str | os.PathLike[str], *,
                base_model: str = "", version: str = "checkpoint") -> CheckpointRefit:
    """Write the LoRA adapter `spec` (as trained) saved in `checkpoint` as a PEFT directory at `out`."""
    from ...executors.reference import execute_local
    from ...layouts.lora import PeftLayout
    from ...planner import compile_plan
    from ..lora.peft_dir import PeftDirectory

    start = time.perf_counter()
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint)
    before = ckpt.bytes_read
    src = checkpoint_layout(ckpt, spec)  # refuses a non-adapter spec's checkpoint mismatch, or a LoRA one's
    directory = PeftDirectory(out, PeftLayout(model=spec), base_model=base_model)
    plan = compile_plan(src, directory.layout)
    execute_local(plan, {0: checkpoint_tensors(ckpt, plan, 0)}, {0: directory.tensors})
    directory.publish(version)
    written = sum(t.numel() * t.element_size() for t in directory.tensors.values())
    return CheckpointRefit(ckpt.bytes_read - before, written, ckpt.record_bytes, time.perf_counter() - start)


def read_checkpoint(checkpoint: str | os.PathLike[str] | Checkpoint, spec: ModelSpec, dst: Layout,
                    out: dict[int, dict[str, Any]], *, group: Any = None, timeout: float = 60.0) -> CheckpointRefit:
    """On every reader process of `group`: send this process's part of the refit of `checkpoint` into `dst`.

    Collective over `group`: reader r is the group's process r, and so is destination rank r.

    Args:
        checkpoint: the torch_dist checkpoint directory (`iter_NNNNNNN/`), or one opened with `open_checkpoint`.
        spec: the model (a LoRA adapter's `lora_spec` with a `PeftLayout`).
        dst: the destination layout, at most as many ranks as the group has.
        out: the destination ranks this process holds (rank -> name -> tensor; empty where it holds none).
        group: the readers' process group (default: the world).
        timeout: seconds the refit may take.

    Returns:
        What this process read and wrote.

    Raises:
        CheckpointError: a broken or hostile checkpoint.
        LayoutMismatchError: the checkpoint disagrees with `spec`.
        ExecutionError: the refit failed (a peer died or timed out).
    """
    import torch.distributed as dist

    from ...executors import make_executor
    from ...executors.binding import Binding
    from ...planner import compile_plan

    start = time.perf_counter()
    group = group if group is not None else dist.group.WORLD
    me, readers = dist.get_rank(group), dist.get_world_size(group)
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint)
    before = ckpt.bytes_read
    plan = compile_plan(checkpoint_layout(ckpt, spec, readers=readers), dst)
    executor = make_executor("collective", plan, Binding(tuple(range(readers)), tuple(range(dst.num_ranks))), me,
                             {me: checkpoint_tensors(ckpt, plan, me)}, out, group=group, timeout=timeout)
    try:
        executor.refit()
    finally:
        executor.close()
    written = sum(t.numel() * t.element_size() for tensors in out.values() for t in tensors.values())
    return CheckpointRefit(ckpt.bytes_read - before, written, ckpt.record_bytes, time.perf_counter() - start)

