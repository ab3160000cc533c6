"""A torch_dist checkpoint as a refit source: its reader layout, checked against the spec, and each reader's
tensors, read lazily from the shard files.

The checkpoint holds global tensors (checkpoint.py), so whatever layout saved it, it is read as
`MegatronLayout(tp=1, pp=1, ep=1, world=readers)`: `readers` data-parallel replicas among which the planner
spreads the reading. Per reader: `open_checkpoint(path)`, `checkpoint_layout(ckpt, spec, readers=n)` (every
problem at once), compile the plan, `checkpoint_tensors(ckpt, plan, rank)`. A LoRA adapter spec reads the
Megatron-Bridge `<module>.adapter.linear_{in,out}.weight` tensors and ignores the base weights beside them.
`saved_facts(ckpt)` tells what the metadata says of the layout that saved it.

Refits from it build no model: `export_hf` (an HF directory), `export_peft` (its LoRA adapter as a PEFT
directory), `read_checkpoint` (each of several reader processes sends its part to any destination an executor
reaches).
"""
from __future__ import annotations

import math
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import ArgumentError, LayoutError, LayoutMismatchError
from ...executors.reference import torch_dtype
from ...layouts import HfLayout, Layout, MegatronLayout, ModelSpec
from .checkpoint import Checkpoint, leading_axes, open_checkpoint
from .check import ADAPTER, LORA, layout_problems
from .derive import vocab_divisor

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight")
# megatron-core's checkpoint keys of the local spec's separate norms (sharded_state_dict_keys_map: the keys of the
# TransformerEngine spec, whose norms are fused into the next linear); a MoE layer of the TE spec keeps its own
# pre_mlp_layernorm, saved under its own name.
_NORM_KEYS = {"input_layernorm.weight": ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
              "pre_mlp_layernorm.weight": ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")}
_SKIP = ("._extra_state",)  # TransformerEngine's FP8 metadata: not weights


@dataclass(frozen=True)
class SavedFacts:
    """What a checkpoint's metadata says about the model and the layout that saved it."""
    padded_vocab: int | None  # rows of the embedding
    num_layers: int | None  # the layer axis of the stacked layer tensors
    num_experts: int | None
    tied: bool  # no output_layer saved
    dtype: str | None
    tp: int | None  # how many row chunks one layer's linear_qkv has
    etp: int | None  # how many row chunks one expert's linear_fc2 has on its columns

    def __str__(self) -> str:
        return (f"saved by tp={self.tp}, etp={self.etp}: {self.num_layers} layers, {self.num_experts or 0} experts, "
                f"vocab {self.padded_vocab} rows, {self.dtype}{', tied' if self.tied else ''}")


def checkpoint_key(name: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Candidate checkpoint keys of a TP=1 Megatron physical tensor, and its index on the (layer, expert) axes."""
    m = _LAYER.fullmatch(name)
    if m is None:
        return (name,), ()
    layer, rest = int(m[1]), m[2]
    e = _EXPERT.fullmatch(rest)
    if e is not None:
        return (f"decoder.layers.mlp.experts.experts.{e[2]}.weight",), (layer, int(e[1]))
    return tuple(f"decoder.layers.{k}" for k in _NORM_KEYS.get(rest, (rest,))), (layer,)


def saved_facts(ckpt: Checkpoint) -> SavedFacts:
    """What the checkpoint's metadata tells of the model and of the TP / ETP that saved it (None: not saved)."""
    t = ckpt.tensors
    embed = t.get("embedding.word_embeddings.weight")
    qkv = t.get("decoder.layers.self_attention.linear_qkv.weight")
    fc2 = t.get("decoder.layers.mlp.experts.experts.linear_fc2.weight")
    layered = [s for k, s in t.items() if k.startswith("decoder.layers.") and not k.endswith(_SKIP)]

    def cuts(saved, dim: int, prefix: int) -> int | None:  # chunks of the first (layer, expert) along dim
        if saved is None:
            return None
        first = [c for c in saved.chunks if all(o == 0 for o in c.offsets[:prefix])]
        return len({c.offsets[dim] for c in first})

    return SavedFacts(padded_vocab=embed.shape[0] if embed else None,
                      num_layers=layered[0].shape[0] if layered else None,
                      num_experts=fc2.shape[1] if fc2 else None, tied="output_layer.weight" not in t,
                      dtype=str(embed.dtype).removeprefix("torch.") if embed else None,
                      tp=cuts(qkv, 1, 1), etp=cuts(fc2, 3, 2))


def checkpoint_layout(ckpt: Checkpoint, spec: ModelSpec, *, readers: int = 1,
                      like: MegatronLayout | None = None) -> MegatronLayout:
    """The reader layout of `ckpt` for `spec`, checked against it and `like` (LayoutMismatchError: every problem)."""
    facts, divisor = saved_facts(ckpt), {}
    adapter = spec.family == LORA  # no vocabulary: its tensors are the checkpoint's `.adapter.` ones
    if not adapter and facts.padded_vocab is None:
        raise LayoutMismatchError("megatron-ckpt", ["the checkpoint has no embedding.word_embeddings.weight"],
                                  where=f"the checkpoint {ckpt.path}")
    try:
        if not adapter:
            divisor["vocab_divisor"] = vocab_divisor(spec.vocab_size, facts.padded_vocab, 1, like)
    except LayoutError as e:
        raise LayoutMismatchError("megatron-ckpt", [str(e)], where=f"the checkpoint {ckpt.path}") from None
    layout = MegatronLayout(model=spec, tp=1, pp=1, ep=1, etp=1, world=readers, **divisor)
    problems = checkpoint_problems(ckpt, layout) + (layout_problems(layout, like) if like is not None else [])
    if problems:
        if adapter:
            fix = "declare the adapter the checkpoint holds (lora_spec: its rank, targets and alpha as trained)"
        elif any(" tensors are saved as " in p for p in problems):
            fix = f"declare the model's dtype as the checkpoint's, {facts.dtype} (ModelSpec dtype, CLI --dtype)"
        else:
            fix = ""
        raise LayoutMismatchError("megatron-ckpt", problems, fix=fix, where=f"the checkpoint {ckpt.path} ({facts})")
    return layout


def checkpoint_problems(ckpt: Checkpoint, layout: MegatronLayout) -> list[str]:
    """Every tensor of the layout's rank 0 against the checkpoint, and every saved weight the layout does not read."""
    if (layout.tp, layout.pp, layout.ep, layout.vpp) != (1, 1, 1, 1):
        return [f"a checkpoint is read as tp=pp=ep=vpp=1 (it stores global tensors), not {layout}"]
    problems, used = [], set()
    dtypes: dict[tuple[torch.dtype, torch.dtype], list[str]] = {}
    for name, shape in layout.rank_tensors(0).items():
        keys, index = checkpoint_key(name)
        found = [k for k in keys if k in ckpt.tensors]
        if not found:
            problems.append(f"{name} {tuple(shape)}: none of {list(keys)} is in the checkpoint")
            continue
        saved = ckpt.tensors[found[0]]
        used.add(saved.key)
        want_dtype = torch_dtype(layout.tensor_dtype(0, name))
        lead, rest = saved.shape[:len(index)], saved.shape[len(index):]
        if len(lead) != len(index) or any(i >= n for i, n in zip(index, lead)) or rest != tuple(shape):
            problems.append(f"{name}: the checkpoint's {saved.key} has shape {saved.shape}, which holds no "
                            f"{tuple(shape)} at {index}")
        elif index and not ckpt.holds(saved.key, index):
            problems.append(f"{name}: the checkpoint's {saved.key} does not hold {index} (layer, expert) whole")
        elif saved.dtype != want_dtype:
            dtypes.setdefault((saved.dtype, want_dtype), []).append(name)
    problems += [f"{len(names)} tensors are saved as {got}, the layout declares {want} (e.g. {names[0]})"
                 for (got, want), names in dtypes.items()]
    adapter = layout.model.family == LORA
    for key, saved in ckpt.tensors.items():
        if key in used or key.endswith(_SKIP) or (adapter and ADAPTER not in key):
            continue  # an adapter refit reads no base weight (a Megatron-Bridge LoRA checkpoint holds both)
        what = (f"an adapter tensor the declared targets {list(layout.model.arch_value('lora_targets'))} do not "
                "include") if adapter else f"not a tensor of the {layout.model.family} spec"
        problems.append(f"the checkpoint's {key} {saved.shape} is {what} (a refit would not read it)")
    for key in used:  # every layer / expert of the checkpoint must be one of the spec's
        saved, lead = ckpt.tensors[key], leading_axes(key)
        want = (layout.model.num_layers, layout.model.num_experts)[:lead]
        if saved.shape[:lead] != want:
            problems.append(f"the checkpoint's {key} has {saved.shape[:lead]} (layers, experts), the spec {want}")
    return problems


def checkpoint_tensors(ckpt: Checkpoint, plan, rank: int) -> dict[str, torch.Tensor]:
    """{physical name: tensor} of reader `rank` of `plan`: what its ops send read in, the rest left unwritten."""
    ops, table = plan.ops_sent_by(rank), plan.src_tensors
    shapes, tensor_ids = plan.src.rank_tensors(rank), ops["src_tensor"]
    sent, out = set(np.unique(tensor_ids).tolist()), {}
    for tid in np.flatnonzero(table.rank == rank):
        name = table.names[tid]
        keys, index = checkpoint_key(name)
        key, shape = next(k for k in keys if k in ckpt.tensors), tuple(shapes[name])
        t = out[name] = torch.empty(shape, dtype=ckpt.tensors[key].dtype)
        if tid not in sent:
            continue
        units_shape, mine = tuple(table.shapes[tid]), tensor_ids == tid
        if len(units_shape) == 1:  # one dimension (norms): read it whole
            spans = [(0, shape[0])]
        else:
            inner = math.prod(units_shape[1:])
            start = ops["src_offset"][mine]
            last = start + (ops["rows"][mine] - 1) * ops["src_stride"][mine] + ops["cols"][mine] - 1
            spans = _merge(zip((start // inner).tolist(), (last // inner + 1).tolist()))
        for lo, hi in spans:
            box = ckpt.read(key, index + (lo,) + (0,) * (len(shape) - 1), (1,) * len(index) + (hi - lo,) + shape[1:])
            t[lo:hi] = box.reshape((hi - lo,) + shape[1:])
    return out


def _merge(spans) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


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
