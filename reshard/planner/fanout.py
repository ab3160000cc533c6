"""Fan-out across destination replicas: the source feeds replica 0; replica k > 0 receives the same bytes
from its parent replica in a `fanout`-ary tree (children of p are p*fanout+1 .. p*fanout+fanout).

Replicas share one layout, so a relay copies a region of the parent's destination tensor to the same region
of the child's: trainer egress is one copy of the model whatever the replica count, no replica forwards more
than `fanout` times what it received, and the depth is ceil(log_fanout(replicas)) stages.
"""
from __future__ import annotations

import numpy as np


def tree_parent_and_depth(num_replicas: int, fanout: int) -> tuple[list[int], list[int]]:
    parent, depth = [-1], [0]
    for k in range(1, num_replicas):
        p = (k - 1) // fanout
        parent.append(p)
        depth.append(depth[p] + 1)
    return parent, depth


def replica_tree_relays(root_ops: dict[str, np.ndarray], num_replicas: int, fanout: int, ranks_per_replica: int,
                        tensors_per_replica: int) -> dict[str, np.ndarray]:
    """Relay ops for replicas 1..K-1, copying what `root_ops` (replica 0's ops) write."""
    parent, depth = tree_parent_and_depth(num_replicas, fanout)
    n = len(root_ops["rows"])
    k = np.repeat(np.arange(1, num_replicas, dtype=np.int64), n)
    p = np.asarray(parent, dtype=np.int64)[k]
    rep = lambda c: np.tile(root_ops[c], num_replicas - 1)  # noqa: E731
    d_rank, d_tensor = rep("dst_rank"), rep("dst_tensor")
    return {
        "stage": np.asarray(depth, dtype=np.int64)[k],  # the root receives in stage 0, depth d in stage d
        "src_side": np.ones_like(k),
        "src_rank": d_rank + p * ranks_per_replica,
        "src_tensor": d_tensor + p * tensors_per_replica,
        "src_offset": rep("dst_offset"),
        "src_stride": rep("dst_stride"),
        "dst_rank": d_rank + k * ranks_per_replica,
        "dst_tensor": d_tensor + k * tensors_per_replica,
        "dst_offset": rep("dst_offset"),
        "dst_stride": rep("dst_stride"),
        "rows": rep("rows"),
        "cols": rep("cols"),
        "canon": rep("canon"),
    }
