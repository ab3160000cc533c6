"""Which verl trainer refits through the configured checkpoint engine, and the checks of the `checkpoint_engine`
block. Imports no verl at module level; `on_import` reads verl's live state when verl imports this package.

verl 0.9.1 (`python -m verl.trainer.main_ppo`; docs/guides/verl.md, Trainer modes, has the table): the v1 trainers
(`trainer.use_v1: true`, the default) set their colocated manager's backend to `naive` in `PPOTrainer._setup`
(verl/trainer/ppo/v1/trainer_base.py); only `trainer_mode: separate_async` builds a second manager with the
configured backend for its standalone rollout replicas. The legacy trainer (`use_v1: false`) has no rollout process
to send to. The experimental entry points (one_step_off_policy, fully_async_policy) use the configured backend.
"""
from __future__ import annotations

import sys
import warnings
from typing import Any, Mapping

from ...errors import ArgumentError

BACKEND = "reshard"
MODULE = "reshard.integrations.verl"
# verl 0.9.1's own backends (verl/checkpoint_engine/*.py): an engine_kwargs entry under one is meant for it
VERL_BACKENDS = ("naive", "nccl", "hccl", "nixl", "mooncake", "kimi_ckpt_engine", "delta_sharded")


class BackendNotUsedWarning(UserWarning):
    """verl refits through another backend than the reshard backend its config selects."""


def _get(config: Any, path: str, default: Any = None) -> Any:
    """`config`'s value at a dotted path (an OmegaConf DictConfig, a dict or a dataclass), or `default`."""
    node = config
    for key in path.split("."):
        if isinstance(node, Mapping) or hasattr(node, "keys"):
            try:
                node = node[key] if key in node else default
            except Exception:  # noqa: BLE001 - a missing value in a struct config
                return default
        else:
            node = getattr(node, key, default)
        if node is default:
            return default
    return node


def backend_in_use(config: Any) -> tuple[bool | None, str]:
    """Whether verl's main_ppo trainer, composed as `config`, refits its rollout through the configured backend, and
    why (None: a trainer this table does not know)."""
    if _get(config, "async_training") is not None:
        return True, "verl.experimental.fully_async_policy builds its manager with the configured backend"
    if not _get(config, "trainer.use_v1", True):
        return False, ("trainer.use_v1=false: the legacy trainer (verl/trainer/ppo/ray_trainer.py) asserts "
                       "hybrid_engine, so the manager's replicas are the trainer's own workers and there is no "
                       "rollout process for the backend to send to")
    mode = _get(config, "trainer.v1.trainer_mode", "sync")
    if mode in ("sync", "colocate_async"):
        return False, (f"trainer.v1.trainer_mode={mode}: verl's PPOTrainer._setup "
                       f"(verl/trainer/ppo/v1/trainer_base.py) sets the manager's backend to naive")
    if mode == "separate_async":
        gpus = int(_get(config, "actor_rollout_ref.rollout.nnodes", 0) or 0) * int(
            _get(config, "actor_rollout_ref.rollout.n_gpus_per_node", 0) or 0)
        if gpus <= 0:
            return False, ("trainer.v1.trainer_mode=separate_async without standalone rollout GPUs "
                           "(actor_rollout_ref.rollout.nnodes x n_gpus_per_node is 0; verl asserts nnodes > 0)")
        hybrid = bool(_get(config, "actor_rollout_ref.hybrid_engine", True))
        return True, ("trainer.v1.trainer_mode=separate_async: the standalone rollout replicas refit through the "
                      "configured backend (verl/trainer/ppo/v1/trainer_separate_async.py)"
                      + ("; the colocated (hybrid) replicas through naive" if hybrid else ""))
    return None, f"trainer.v1.trainer_mode={mode} is not one of verl 0.9.1's trainers"


def check_checkpoint_engine(ce: Any) -> list[str]:
    """Check a `checkpoint_engine` block that selects reshard (a config object or dict). Raises ArgumentError
    naming the first key that reaches no backend; returns notes on keys meant for verl's other backends."""
    from .topology import check_options

    kwargs = _get(ce, "engine_kwargs") or {}
    keys = list(kwargs.keys()) if hasattr(kwargs, "keys") else []
    stray = [k for k in keys if k != BACKEND and k not in VERL_BACKENDS]
    if stray:
        raise ArgumentError(f"checkpoint_engine.engine_kwargs.{stray[0]}", kwargs[stray[0]],
                            f"is not a backend name: verl hands a backend only engine_kwargs.<its name>, so "
                            f"{stray} reach no backend", fix="put the reshard backend's options under "
                                                              "engine_kwargs.reshard")
    if BACKEND not in keys:
        raise ArgumentError("checkpoint_engine.engine_kwargs.reshard", None, "is missing: the reshard backend needs "
                            "at least `model` (the HF model's config path or directory)")
    options = dict(kwargs[BACKEND] or {})
    if options.get("model") in (None, ""):
        raise ArgumentError("checkpoint_engine.engine_kwargs.reshard.model", options.get("model"),
                            "is required: the HF config of the model (a config.json path or checkpoint directory)")
    check_options({k: v for k, v in options.items() if k not in ("model", "dtype", "host", "device")})
    return [f"engine_kwargs.{k} is for the {k} backend; verl ignores it while backend is reshard"
            for k in keys if k in VERL_BACKENDS]


def not_used_message(manager_config: Any, trainer_config: Any = None) -> str | None:
    """What to tell a user whose verl manager (`manager_config`) does not refit through reshard; None when it does,
    or when the trainer (`trainer_config`, None if unknown) refits other replicas through reshard."""
    backend = _get(manager_config, "backend")
    if backend == BACKEND:
        return None
    used, why = backend_in_use(trainer_config) if trainer_config is not None else (None, "")
    if used:  # this manager is separate_async's colocated one; the standalone one is built with reshard
        return None
    return (f"verl builds its CheckpointEngineManager with backend {backend!r}, not reshard, although "
            f"checkpoint_engine.custom_backend_module names {MODULE}: "
            + (why if why else "verl 0.9.1's v1 trainers (trainer.use_v1=true) in trainer_mode sync (the default) "
               "and colocate_async set the backend to naive in PPOTrainer._setup (verl/trainer/ppo/v1/trainer_base.py)")
            + ". The reshard engines built on the actor ranks are never used. To refit through reshard, run "
              "trainer.v1.trainer_mode=separate_async with standalone rollout GPUs (actor_rollout_ref.rollout.nnodes "
              "> 0), or one of verl's disaggregated entry points (docs/guides/verl.md, Trainer modes)")


def refuse_eplb(trainer_config: Any) -> None:
    """Refuse a trainer that refits an EPLB vLLM rollout through reshard: vLLM's `load_weights` writes experts by
    the initial placement (integrations.groups.refuse_moved_experts), and this backend's rollout rank runs beside
    the vLLM workers, so it cannot read their placement.

    Raises:
        ArgumentError: naming the key that enables EPLB.
    """
    key = "actor_rollout_ref.rollout.engine_kwargs.vllm.enable_eplb"
    if trainer_config is None or not _get(trainer_config, key, False) or not backend_in_use(trainer_config)[0]:
        return
    raise ArgumentError(key, True, "loads through vLLM's load_weights, which writes experts by vLLM's initial "
                        "placement: after EPLB rebalances, every expert it moved would be written into another "
                        "expert's slot, and verl gives the backend no way to read the placement first",
                        fix="turn EPLB off, or refit through reshard's vLLM weight-transfer engine, which follows "
                            "the placement (docs/guides/vllm.md, Engines that rebalance experts)")


def _trainer_config(frame: Any) -> Any:
    """The whole trainer config of a verl trainer object (or a subclass) in a frame running `frame`, or None."""
    owner = frame.f_locals.get("self")
    config = getattr(owner, "config", None) if any(c.__module__.startswith("verl.") for c in type(owner).__mro__) \
        else None
    if config is not None and _get(config, "actor_rollout_ref.rollout.checkpoint_engine") is not None \
            and _get(config, "trainer") is not None:
        return config
    return None


def on_import() -> str | None:
    """Run at verl's first import of this package; in the driver, from `CheckpointEngineManager.__init__` with the
    manager's config: a block naming reshard's module is checked (`check_checkpoint_engine`, `refuse_eplb`:
    ArgumentError before any weights move), and a manager verl built with another backend gets a
    BackendNotUsedWarning unless the trainer refits other replicas through reshard. Returns the warning's text
    (None: nothing to say)."""
    base = sys.modules.get("verl.checkpoint_engine.base")
    manager_cls = getattr(base, "CheckpointEngineManager", None)
    if manager_cls is None:
        return None
    from ..groups import outer_frame

    frame = outer_frame(sys._getframe(1), lambda f: f.f_code is manager_cls.__init__.__code__)
    if frame is None:  # a worker's import (trainer init_model, CheckpointEngineWorker) or the user's own
        return None
    config = frame.f_locals.get("config")
    if _get(config, "custom_backend_module") != MODULE and _get(config, "backend") != BACKEND:
        return None
    check_checkpoint_engine(config)
    found = outer_frame(frame.f_back, lambda f: _trainer_config(f) is not None)
    trainer = _trainer_config(found) if found is not None else None
    refuse_eplb(trainer)
    message = not_used_message(config, trainer)
    if message is None:
        return None
    warnings.warn(message, BackendNotUsedWarning, stacklevel=2)
    return message


__all__ = ["BACKEND", "BackendNotUsedWarning", "MODULE", "VERL_BACKENDS", "backend_in_use", "check_checkpoint_engine",
           "not_used_message", "on_import", "refuse_eplb"]
