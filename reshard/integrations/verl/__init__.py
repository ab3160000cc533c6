"""reshard as a verl checkpoint engine: name this module in verl's config and select the backend (a Hydra config
file's keys, nested as verl's config nests them; docs/guides/verl.md has the command-line form, the trainer modes
that use the backend, and both forms tested):

    actor_rollout_ref:
      rollout:
        checkpoint_engine:
          backend: reshard
          custom_backend_module: reshard.integrations.verl
          update_weights_bucket_megabytes: 512
          engine_kwargs:
            reshard: {model: /path/to/hf/model, transport: collective, fanout: 2}

verl imports the module in its driver, trainer and rollout processes; importing it registers
`ReshardCheckpointEngine` under "reshard" in verl's `CheckpointEngineRegistry`. In the driver the import also checks
the block (`modes.on_import`): a key that reaches no backend is an error, and a manager verl built with another
backend (the v1 trainers' `naive`, trainer_mode sync and colocate_async) is a BackendNotUsedWarning. Where verl is
not installed the import succeeds and registers nothing (`ReshardCheckpointEngine` is None). The plans: `topology`;
the engine and its lifecycle: `engine`; the trainer modes and the config checks: `modes`.
"""
from __future__ import annotations

try:
    import verl.checkpoint_engine  # noqa: F401 - probe only: the engine module needs it
except ImportError:
    ReshardCheckpointEngine = None
    BACKEND = "reshard"
else:
    from .engine import BACKEND, ReshardCheckpointEngine
    from .modes import on_import

    # verl's driver imports this package while it builds a CheckpointEngineManager: check the block that names it
    # (keys that reach no backend fail here) and say so when verl has replaced the reshard backend (modes.py)
    on_import()

__all__ = ["BACKEND", "ReshardCheckpointEngine"]
