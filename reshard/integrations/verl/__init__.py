"""reshard as a verl checkpoint engine: name this module in verl's config and select the backend

    actor_rollout_ref.rollout.checkpoint_engine:
      backend: reshard
      custom_backend_module: reshard.integrations.verl
      update_weights_bucket_megabytes: 512
      engine_kwargs:
        reshard: {model: /path/to/hf/model, transport: collective, fanout: 2}

verl imports the module in its driver, trainer and rollout processes; importing it registers
`ReshardCheckpointEngine` under "reshard" in verl's `CheckpointEngineRegistry`. Where verl is not installed the
import succeeds and registers nothing (`ReshardCheckpointEngine` is None). The plans: `topology`; the engine and
its lifecycle: `engine`.
"""
from __future__ import annotations

try:
    import verl.checkpoint_engine  # noqa: F401 - probe only: the engine module needs it
except ImportError:
    ReshardCheckpointEngine = None
    BACKEND = "reshard"
else:
    from .engine import BACKEND, ReshardCheckpointEngine

__all__ = ["BACKEND", "ReshardCheckpointEngine"]
