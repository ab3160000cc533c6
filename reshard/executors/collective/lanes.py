"""Lanes: extra communicators over the processes of a refit group, so that rounds overlap on the link.

NCCL runs one communicator's point-to-point operations one after another, each with a fixed cost; with rounds
alternating between communicators that cost all but goes (BENCHMARKS.md, NCCL). Round r travels on lane r mod n,
which both ends derive from the round's global index; on each lane a pair posts its messages in round order.
Three by default on NCCL (`NCCL_LANES`): a refit where both GPUs send and receive reaches its share of the link
with three, not one, and a fourth gained nothing.

Lanes are made once per group and process, by every member together in its first refit, right after the
preflight. torch names a new group after a per-process count, and members that disagree on the name would wait
for each other forever: the preflight compares `naming_count`, and where it differs the executor stays on one lane.
"""
from __future__ import annotations

import torch.distributed as dist

NCCL_LANES = 3  # the default on NCCL (module docstring)
_LANES: dict[int, tuple[object, list]] = {}  # id(group) -> (group, its extra lanes); the group is kept alive
_FAILED: set[int] = set()  # groups whose lanes could not be made


def lanes_for(group, n: int, backend: str, timeout: float | None = None) -> list:
    """`group` followed by n - 1 communicators over the same processes (made on first use, then reused), each
    with `timeout` seconds for any wait (not torch's defaults)."""
    if n <= 1:
        return [group]
    entry = _LANES.get(id(group))
    if entry is None or entry[0] is not group:
        entry = _LANES[id(group)] = (group, [])
    extra = entry[1]
    while len(extra) < n - 1 and id(group) not in _FAILED:
        try:
            extra.append(_new_lane(group, backend, timeout))
        except Exception:  # noqa: BLE001 - a torch that cannot make them fails alike on every member:
            _FAILED.add(id(group))  # stay on the lanes made so far, and do not try again
    return [group, *extra[:n - 1]]


def naming_count(group) -> int:
    """The count torch will name the next lane after (see the module docstring); -1 if unknown."""
    world = getattr(dist.distributed_c10d, "_world", None)
    try:
        if _whole_world(group):
            return int(world.group_count)
        return len(world.pg_names)
    except AttributeError:
        return -1


def _whole_world(group) -> bool:
    return dist.get_world_size(group) == dist.get_world_size()


def forget(group) -> None:
    """Drop a group's lanes (after an abort they are as unusable as the group itself)."""
    _LANES.pop(id(group), None)
    _FAILED.discard(id(group))


def _new_lane(group, backend: str, timeout: float | None = None):
    from datetime import timedelta

    ranks = dist.get_process_group_ranks(group)
    limit = {"timeout": timedelta(seconds=timeout)} if timeout is not None else {}
    if _whole_world(group):  # every process is a member and calls this: torch's usual collective new_group
        return dist.new_group(ranks=ranks, backend=backend, **limit)
    default = dist.distributed_c10d._get_default_group()
    if backend == "nccl" and default.bound_device_id is not None:
        # a device-bound world makes NCCL groups by splitting a parent communicator; splitting the refit group
        # itself involves only its members (new_group would split the world's, needing every process)
        return dist.split_group(parent_pg=group, split_ranks=[list(range(dist.get_world_size(group)))], **limit)
    return dist.new_group(ranks=ranks, backend=backend, use_local_synchronization=True, **limit)


__all__ = ["NCCL_LANES", "forget", "lanes_for", "naming_count"]
