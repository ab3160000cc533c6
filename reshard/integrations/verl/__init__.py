"""reshard as a verl checkpoint engine: name this module in verl's config and select the backend
(docs/guides/verl.md has the command-line form and the trainer modes that use it):

    actor_rollout_ref:
      rollout:
        checkpoint_engine:
          backend: reshard
          custom_backend_module: reshard.integrations.verl
          update_weights_bucket_megabytes: 512
          engine_kwargs:
            reshard: {model: /path/to/hf/model, transport: collective, fanout: 2}

Importing it registers `ReshardCheckpointEngine` (None without verl) under "reshard" and, in verl's driver, checks
the block (`modes.on_import`). The plans: `topology`; the engine: `engine`; trainer modes and checks: `modes`.
"""
from __future__ import annotations

from .modes import BACKEND

try:
    import verl.checkpoint_engine  # noqa: F401 - probe only: the engine module needs it
except ImportError:
    ReshardCheckpointEngine = None
else:
    from .engine import ReshardCheckpointEngine
    from .modes import on_import

    on_import()  # in verl's driver: check the block, warn when verl replaced the backend

__all__ = ["BACKEND", "ReshardCheckpointEngine"]
