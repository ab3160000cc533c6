"""What a delta (planner.delta.DeltaOps) writes and weighs, for tests to compare with the elements whose value
changed: only tests use these."""
from __future__ import annotations

import numpy as np

from reshard.planner.delta import DENSE, DeltaOps, _box, encoded_bytes
from reshard.planner.merge import run_positions


def wire_bytes(plan, delta: DeltaOps) -> int:
    """Bytes of the entries' encodings (without headers)."""
    return int(np.take_along_axis(encoded_bytes(_box(plan, delta.op), delta.count, plan.itemsize),
                                  delta.encoding[:, None].clip(0, 2), axis=1).sum())


def written(plan, delta: DeltaOps) -> tuple[np.ndarray, np.ndarray]:
    """(destination table id, flat element position) of every element `delta` writes, in entry order."""
    o = plan.ops
    box = _box(plan, delta.op)
    dense = delta.encoding == DENSE
    count = np.where(dense, box, delta.count)
    owner = np.repeat(np.arange(len(delta)), count)
    idx = run_positions(count)  # index within the entry
    idx[~dense[owner]] = delta.index.cpu().numpy()
    op = delta.op[owner]
    cols = o["cols"][op]
    position = o["dst_offset"][op] + (idx // cols) * o["dst_stride"][op] + idx % cols
    return o["dst_tensor"][op], position
