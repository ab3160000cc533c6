"""The one reader of a live megatron-core GPT model: `read_model` turns it, once, into ModelFacts (this rank's
parallel state, live tensors, layer numbers, config), from which the layout is derived and checked. Names are a
chunk's parameter names, prefixed `model{c}.` under virtual pipelining. Nothing here copies a tensor.
"""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from ...errors import LayoutError

# Our name for a group -> (the ProcessGroupCollection field, the megatron.core.parallel_state getter) holding it.
# Data parallel counts context-parallel ranks too: weights are replicated across both.
_GROUPS = {"tp": ("tp", "get_tensor_model_parallel_group"), "pp": ("pp", "get_pipeline_model_parallel_group"),
           "dp": ("dp_cp", "get_data_parallel_group"), "ep": ("ep", "get_expert_model_parallel_group"),
           "etp": ("expt_tp", "get_expert_tensor_parallel_group"), "edp": ("expt_dp", "get_expert_data_parallel_group")}


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in megatron-core's parallel state: sizes, and the members of each of its groups."""
    rank: int
    world: int
    groups: Mapping[str, tuple[int, ...]]  # 'tp', 'pp', 'dp', 'ep', 'etp', 'edp' -> this rank's group, in order

    def size(self, axis: str) -> int:
        """The size of this rank's group on `axis` ('tp', 'pp', 'dp', 'ep', 'etp', 'edp')."""
        return len(self.groups[axis])


@dataclass(frozen=True)
class ConfigFacts:
    """What the spec checks read off a GPTModel chunk: its TransformerConfig and three facts kept on the module."""
    transformer: Any
    padded_vocab: int  # the embedding's rows: the true vocabulary padded by the trainer
    tied: bool  # share_embeddings_and_output_weights
    position_embedding_type: str

    @classmethod
    def of(cls, model: Any) -> ConfigFacts:
        """Read off a GPTModel chunk, or the ones ModelFacts already hold (their `config`)."""
        if isinstance(model.config, ConfigFacts):
            return model.config
        return cls(model.config, model.vocab_size, bool(model.share_embeddings_and_output_weights),
                   getattr(model, "position_embedding_type", "rope"))


@dataclass(frozen=True, eq=False)
class ModelFacts:
    """One rank's live model as plain facts (read-only mappings of the live parameters and buffers, not copies)."""
    parallel_state: ParallelState
    parameters: Mapping[str, torch.Tensor]  # physical name -> live parameter
    buffers: Mapping[str, torch.Tensor]  # physical name -> persistent buffer (model state, e.g. expert_bias)
    layers: Mapping[tuple[int, int], int]  # (chunk, index in its decoder.layers) -> global layer number
    vpp: int  # number of virtual pipeline chunks
    config: ConfigFacts  # of the first chunk: every chunk is built from the same config

    def __post_init__(self) -> None:
        for field in ("parameters", "buffers", "layers"):  # read-only views of private copies
            object.__setattr__(self, field, MappingProxyType(dict(getattr(self, field))))

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """Everything a refit may read: the parameters and the persistent buffers."""
        return {**self.parameters, **self.buffers}

    def __repr__(self) -> str:  # the tensors themselves would fill a terminal
        sizes = " ".join(f"{axis}={self.parallel_state.size(axis)}" for axis in self.parallel_state.groups)
        return (f"ModelFacts(rank {self.parallel_state.rank} of {self.parallel_state.world}, {sizes}, vpp={self.vpp}, "
                f"{len(self.parameters)} parameters, {len(self.buffers)} buffers, {len(self.layers)} layers)")


def read_model(model: Any) -> ModelFacts:
    """The facts of `model` (a GPTModel, possibly wrapped, or its list of virtual pipeline chunks; ModelFacts as is)."""
    if isinstance(model, ModelFacts):
        return model
    chunks = unwrap(model)
    prefixes = [f"model{c}." if len(chunks) > 1 else "" for c in range(len(chunks))]
    params = {p + name: t for p, chunk in zip(prefixes, chunks) for name, t in chunk.named_parameters()}
    buffers = {name: b for p, chunk in zip(prefixes, chunks) for name, b in state_buffers(chunk, p).items()}
    layers = {(c, i): layer.layer_number - 1
              for c, chunk in enumerate(chunks) for i, layer in enumerate(chunk.decoder.layers)}
    return ModelFacts(parallel_state=read_parallel_state(chunks), parameters=params, buffers=buffers, layers=layers,
                      vpp=len(chunks), config=ConfigFacts.of(chunks[0]))


def read_parallel_state(chunks: Sequence[Any]) -> ParallelState:
    """This rank's process groups, from the model's `pg_collection` or `megatron.core.parallel_state`."""
    if not dist.is_initialized():
        raise LayoutError("megatron", "torch.distributed is not initialized; a live model needs its process groups")
    pgc = getattr(chunks[0], "pg_collection", None)
    groups = {}
    for axis, (field, getter) in _GROUPS.items():
        if pgc is not None:
            group = getattr(pgc, field, None)
        else:  # older megatron-core
            from megatron.core import parallel_state

            group = getattr(parallel_state, getter)(**({"with_context_parallel": True} if axis == "dp" else {}))
        groups[axis] = tuple(dist.get_process_group_ranks(group)) if group is not None else (dist.get_rank(),)
    for field in ("gtp_remat", "expt_gtp_remat"):
        group = getattr(pgc, field, None)
        if group is not None and dist.get_world_size(group) > 1:
            raise LayoutError("megatron", f"{field} size {dist.get_world_size(group)} > 1: weight "
                              "rematerialization shards parameters further, which the Megatron layout does not "
                              "describe")
    return ParallelState(rank=dist.get_rank(), world=dist.get_world_size(), groups=MappingProxyType(groups))


def state_buffers(chunk: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """The persistent buffers of `chunk` (e.g. the router's `expert_bias`), by prefixed name."""
    return {prefix + (f"{mod_name}.{name}" if mod_name else name): buf
            for mod_name, module in chunk.named_modules() for name, buf in module._buffers.items()
            if buf is not None and name not in module._non_persistent_buffers_set}


def unwrap(model: Any) -> list[Any]:
    """The GPTModel chunks of `model` without DDP / Float16Module wrappers; fully sharded data parallel is refused."""
    from megatron.core.models.gpt import GPTModel

    wrappers, sharded = _wrapper_types()
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if not chunks:
        raise LayoutError("megatron", "no model chunks given")
    out = []
    for c, module in enumerate(chunks):
        while isinstance(module, wrappers):
            module = module.module
        if sharded and isinstance(module, sharded):
            raise LayoutError("megatron", f"chunk {c} is wrapped in {type(module).__name__}: fully sharded data "
                              "parallel splits parameters across data-parallel ranks, which the Megatron layout "
                              "does not describe", fix="refit from a model wrapped in megatron DDP instead")
        if not isinstance(module, GPTModel):
            raise LayoutError("megatron", f"chunk {c} is a {type(module).__name__}, not a megatron-core GPTModel")
        out.append(module)
    for c, module in enumerate(out):
        if len(out) > 1 and module.vp_stage != c:
            raise LayoutError("megatron", f"chunk {c} was built with vp_stage={module.vp_stage}; pass the "
                              "virtual pipeline chunks in order", values={"chunk": c, "vp_stage": module.vp_stage})
    return out


def _wrapper_types() -> tuple[tuple[type, ...], tuple[type, ...]]:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    sharded: list[type] = []
    for module, name in (("megatron.core.distributed", "TorchFullyShardedDataParallel"),
                         ("megatron.core.distributed.fsdp.mcore_fsdp_adapter", "FullyShardedDataParallel")):
        with contextlib.suppress(ImportError, AttributeError):  # optional in some megatron-core builds
            sharded.append(getattr(importlib.import_module(module), name))
    return (DistributedDataParallel, Float16Module), tuple(sharded)

