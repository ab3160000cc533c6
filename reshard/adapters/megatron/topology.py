"""This rank's place in megatron-core's parallel state: sizes, and the members of each of its groups.

Read from the model's `pg_collection` (megatron-core >= 0.14 keeps one on every module) or, for older models,
from `megatron.core.parallel_state`. Only process-group membership is read: no collective runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from ...errors import LayoutError

# Our name for a group -> the ProcessGroupCollection field holding it. Data parallel counts context-parallel
# ranks too: weights are replicated across both, and with the default order they are adjacent axes.
_GROUPS = {"tp": "tp", "pp": "pp", "dp": "dp_cp", "ep": "ep", "etp": "expt_tp", "edp": "expt_dp"}


@dataclass(frozen=True)
class Topology:
    rank: int
    world: int
    groups: Mapping[str, tuple[int, ...]]  # 'tp', 'pp', 'dp', 'ep', 'etp', 'edp' -> this rank's group, in order

    def size(self, axis: str) -> int:
        return len(self.groups[axis])

    def coord(self, axis: str) -> int:
        return self.groups[axis].index(self.rank)


def read_topology(chunks: list[Any]) -> Topology:
    import torch.distributed as dist

    if not dist.is_initialized():
        raise LayoutError("megatron", "torch.distributed is not initialized; a live model needs its process groups")
    pgc = getattr(chunks[0], "pg_collection", None)
    groups = {}
    for axis, field in _GROUPS.items():
        group = getattr(pgc, field, None) if pgc is not None else _parallel_state_group(field)
        groups[axis] = tuple(dist.get_process_group_ranks(group)) if group is not None else (dist.get_rank(),)
    for field in ("gtp_remat", "expt_gtp_remat"):
        group = getattr(pgc, field, None)
        if group is not None and dist.get_world_size(group) > 1:
            raise LayoutError("megatron", f"{field} size {dist.get_world_size(group)} > 1: weight "
                              "rematerialization shards parameters further, which the Megatron layout does not "
                              "describe")
    return Topology(rank=dist.get_rank(), world=dist.get_world_size(), groups=MappingProxyType(groups))


def _parallel_state_group(field: str) -> Any:
    from megatron.core import parallel_state as ps

    getters = {
        "tp": ps.get_tensor_model_parallel_group,
        "pp": ps.get_pipeline_model_parallel_group,
        "dp_cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
        "ep": ps.get_expert_model_parallel_group,
        "expt_tp": ps.get_expert_tensor_parallel_group,
        "expt_dp": ps.get_expert_data_parallel_group,
    }
    return getters[field]()
