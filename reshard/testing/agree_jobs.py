"""Workers of one engine agreeing on a step (adapters.vllm.agreed) over a real gloo group, one of them frozen: for
the test that the agreement's wait is bounded."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def agree_with_a_frozen_peer(job: dict[str, Any]) -> None:
    """Rank 0 agrees on a step with `job["timeout"]`; the last rank is frozen (sleeps) instead. Rank 0 writes how
    it ended and after how long to job["out"]."""
    import torch.distributed as dist

    from ..adapters.vllm.agreed import agreed

    rank = dist.get_rank()
    if rank == dist.get_world_size() - 1:
        time.sleep(job["frozen_s"])
        return
    t0 = time.monotonic()
    try:
        agreed("update", lambda: None, timeout=job["timeout"], group=dist.group.WORLD)
        outcome = "agreed"
    except Exception as e:  # noqa: BLE001 - what the test checks
        outcome = f"{type(e).__name__}: {e}"
    Path(job["out"]).write_text(json.dumps({"outcome": outcome, "seconds": time.monotonic() - t0}))
