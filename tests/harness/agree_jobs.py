"""Waits over a real gloo group with one member frozen, for the tests that they are bounded: workers of one engine
agreeing on a step (adapters.vllm.session.agreed), trainer processes sharing the rendezvous (TrainerSession.init)."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def agree_with_a_frozen_peer(job: dict[str, Any]) -> None:
    """Rank 0 agrees on a step with `job["timeout"]`; the last rank is frozen (sleeps) instead. Rank 0 writes how
    it ended and after how long to job["out"]."""
    import torch.distributed as dist

    from reshard.adapters.vllm.session import agreed

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


def rendezvous_without_process_0(job: dict[str, Any]) -> None:
    """Trainer process 0 is frozen (sleeps) instead of sharing the rendezvous over the trainer group (a group whose
    own timeout is an hour); process 1's `TrainerSession.init` with `job["timeout"]` writes how it ended and after
    how long to job["out"]."""
    from datetime import timedelta

    import torch.distributed as dist

    import reshard
    from reshard.adapters.refit import RefitSpec
    from reshard.adapters.trainer import TrainerSession
    from reshard.executors import shard

    from reshard.testing.megatron_cpu import TinyGPT

    group = dist.new_group([0, 1], timeout=timedelta(hours=1))
    if dist.get_rank() == 0:
        time.sleep(job["frozen_s"])
        return
    spec = reshard.ModelSpec.from_hf_config(TinyGPT().hf_config().to_dict())
    src = reshard.MegatronLayout(model=spec, tp=2)
    refit = RefitSpec.of(spec, src, reshard.VllmLayout(model=spec), install="loader", transport="collective")
    import torch

    tensors = shard(src, {t.name: torch.zeros(t.shape) for t in spec.tensors}, ranks=[1])[1]
    session = TrainerSession(refit, 1, tensors, trainer_group=group, timeout=job["timeout"])
    t0 = time.monotonic()
    try:
        session.init()
        outcome = "joined"
    except Exception as e:  # noqa: BLE001 - what the test checks
        outcome = f"{type(e).__name__}: {e}"
    Path(job["out"]).write_text(json.dumps({"outcome": outcome, "seconds": time.monotonic() - t0}))
