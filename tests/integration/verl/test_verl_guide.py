"""The configuration blocks of docs/guides/verl.md, as a user pastes them, through verl's own Hydra composition
(verl 0.9.1's `ppo_trainer` config, what `python -m verl.trainer.main_ppo` composes) and into a refit through verl's
CheckpointEngineManager (harness.verl_cpu, a local Ray cluster).

Every fenced block that follows an HTML comment `<!-- verl-test: KIND -->` is extracted: KIND "config-file" is a
Hydra config file of the user's (composed as the primary config, verl's configs on its search path), "cli" a shell
command whose `key=value` arguments are Hydra overrides of `ppo_trainer`. The model path placeholder is replaced with
a real checkpoint. Also here: the two traps the guide names (a dotted top-level YAML key is silently a literal key;
`engine_kwargs.reshard.*` on the command line without `+` is refused by Hydra), which trainer modes refit through
the configured backend (reshard.integrations.verl.modes, on configs composed by verl), the warning a user gets when
verl replaces the backend, and the error for a key that would reach no backend.
"""
from __future__ import annotations

import re
import shlex
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.verl

ROOT = Path(__file__).resolve().parents[3]
GUIDE = ROOT / "docs/guides/verl.md"
PLACEHOLDER = "/path/to/hf/model"
CE = "actor_rollout_ref.rollout.checkpoint_engine"
# the guide's block before issue 43, as users pasted it: a dotted key at the top of a YAML file
OLD_BLOCK = """actor_rollout_ref.rollout.checkpoint_engine:
  backend: reshard
  custom_backend_module: reshard.integrations.verl
  update_weights_bucket_megabytes: 512
  engine_kwargs: {reshard: {model: /path/to/hf/model, transport: collective, fanout: 2, checksum: true}}
"""


def guide_blocks() -> list[tuple[str, str]]:
    """(kind, text) of every block of the guide marked for testing, in order."""
    found = re.findall(r"<!-- verl-test: ([\w-]+) -->\s*\n```[^\n]*\n(.*?)\n```", GUIDE.read_text(), re.S)
    return [(kind, text + "\n") for kind, text in found]


def cli_overrides(command: str) -> list[str]:
    """The Hydra overrides of a `python -m verl.trainer.main_ppo ...` command line (its `key=value` arguments)."""
    words = shlex.split(command.replace("\\\n", " "), comments=True)
    assert "verl.trainer.main_ppo" in words, command
    return [w for w in words[words.index("verl.trainer.main_ppo") + 1:] if "=" in w and not w.startswith("-")]


def compose(config_dir: str | None = None, name: str = "ppo_trainer", overrides: list[str] = ()) -> Any:
    """verl's trainer config as Hydra composes it for main_ppo (`config_dir`: the user's config directory, with
    the user's file `name` in it; None: verl's own directory)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import verl.trainer.config

    directory = config_dir or str(Path(verl.trainer.config.__file__).parent)
    with initialize_config_dir(config_dir=directory, version_base=None):
        return hydra_compose(config_name=name, overrides=list(overrides))


def composed_blocks(tmp_path: Path, checkpoint: str) -> list[tuple[str, Any]]:
    out = []
    for i, (kind, text) in enumerate(guide_blocks()):
        text = text.replace(PLACEHOLDER, checkpoint)
        if kind == "config-file":
            directory = tmp_path / f"block{i}"
            directory.mkdir()
            (directory / "reshard_ppo.yaml").write_text(text)
            out.append((kind, compose(str(directory), "reshard_ppo")))
        elif kind == "cli":
            out.append((kind, compose(overrides=cli_overrides(text))))
        else:
            raise AssertionError(f"docs/guides/verl.md marks a block with an unknown kind {kind!r}")
    return out


def test_the_guide_marks_both_forms():
    kinds = [kind for kind, _ in guide_blocks()]
    assert sorted(set(kinds)) == ["cli", "config-file"], kinds


def test_every_guide_block_composes_and_refits(tmp_path, megatron_refit):
    """The refit: the session's workers (conftest.py), reset to the guide's engine."""
    from omegaconf import OmegaConf

    from reshard.integrations.verl import modes

    checkpoint = megatron_refit.checkpoint
    blocks = composed_blocks(tmp_path, checkpoint)
    ces = []
    for kind, cfg in blocks:
        ce = OmegaConf.to_container(OmegaConf.select(cfg, CE), resolve=True)
        assert ce["backend"] == "reshard" and ce["custom_backend_module"] == "reshard.integrations.verl", (kind, ce)
        assert ce["engine_kwargs"]["reshard"]["model"] == checkpoint, (kind, ce)
        used, why = modes.backend_in_use(cfg)
        assert used, f"the guide's {kind} block selects a trainer that does not use the backend: {why}"
        modes.check_checkpoint_engine(OmegaConf.select(cfg, CE))
        ces.append(ce)
    assert all(ce == ces[0] for ce in ces), "the guide's two forms configure different engines"

    refit = megatron_refit
    refit.reset(ces[0])
    for step in (1, 2):
        refit.trainers.train_step(step)
        refit.refit(step)
        expected = refit.expected()
        for r, (version, digests) in enumerate(refit.served()):
            assert version == step and digests == expected, f"rollout rank {r} after step {step}"


def test_a_dotted_top_level_yaml_key_is_silently_ignored(tmp_path):
    """The trap the guide's old block fell into: OmegaConf keeps the dotted key as one literal key."""
    head = "hydra:\n  searchpath:\n    - pkg://verl.trainer.config\ndefaults:\n  - ppo_trainer\n  - _self_\n"
    text = head + OLD_BLOCK
    (tmp_path / "old.yaml").write_text(text)
    cfg = compose(str(tmp_path), "old")
    assert CE in cfg  # the literal key
    assert cfg.actor_rollout_ref.rollout.checkpoint_engine.backend == "naive"
    assert cfg.actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module is None


def test_engine_kwargs_on_the_command_line_need_a_plus():
    from hydra.errors import ConfigCompositionException

    (_, text), = [b for b in guide_blocks() if b[0] == "cli"]
    without_plus = [o.lstrip("+") for o in cli_overrides(text)]
    with pytest.raises(ConfigCompositionException) as refused:
        compose(overrides=without_plus)
    assert "engine_kwargs.reshard" in str(refused.value) and "+" in str(refused.value)


@pytest.mark.parametrize("overrides,used", [
    ([], False),  # verl's defaults: use_v1, sync
    (["trainer.v1.trainer_mode=colocate_async"], False),
    (["trainer.v1.trainer_mode=separate_async"], False),  # no standalone rollout GPUs (verl asserts nnodes > 0)
    (["trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.rollout.nnodes=1"], True),
    (["trainer.use_v1=false"], False),
])
def test_trainer_modes_of_verls_composed_config(overrides, used):
    from reshard.integrations.verl import modes

    got, why = modes.backend_in_use(compose(overrides=overrides))
    assert got is used, why


def _manager_import(ce: Any) -> tuple[list[str], BaseException | None]:
    """Build verl's CheckpointEngineManager from `ce` (a CheckpointEngineConfig) in this process, with verl's driver
    importing reshard's module afresh as it does in a new driver process. Returns the BackendNotUsedWarning texts
    and the error raised."""
    from verl.checkpoint_engine import CheckpointEngineManager

    from reshard.integrations.verl.modes import BackendNotUsedWarning

    sys.modules.pop("reshard.integrations.verl", None)  # so verl's import_external_libs runs the package again

    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            CheckpointEngineManager(config=ce, actor_wg=None, replicas=[])
        except Exception as e:  # noqa: BLE001 - examined by the caller
            error = e
    return [str(w.message) for w in caught if issubclass(w.category, BackendNotUsedWarning)], error


def _as_verl_trainer_sets_it(overrides: list[str]) -> tuple[Any, Any]:
    """The composed config, and its checkpoint_engine block as verl's PPOTrainer._setup hands it to the manager
    it refits the colocated replicas with (trainer_base.py: omega_conf_to_dataclass, then backend = "naive")."""
    from verl.utils.config import omega_conf_to_dataclass

    cfg = compose(overrides=overrides)
    ce = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout.checkpoint_engine)
    ce.backend = "naive"
    return cfg, ce


def _guide_cli(drop: tuple[str, ...] = ()) -> list[str]:
    (_, text), = [b for b in guide_blocks() if b[0] == "cli"]
    return [o for o in cli_overrides(text.replace(PLACEHOLDER, "/tmp/model")) if not o.startswith(drop)]


def test_a_trainer_mode_that_replaces_the_backend_is_told():
    """The guide's command line without its mode lines: verl's default trainer (sync) refits through naive."""
    _, ce = _as_verl_trainer_sets_it(_guide_cli(drop=("trainer.v1.", "actor_rollout_ref.rollout.nnodes")))
    told, error = _manager_import(ce)
    assert error is None, error
    assert len(told) == 1 and "'naive'" in told[0] and "separate_async" in told[0], told
    # the manager verl builds with the configured backend (separate_async's standalone one) says nothing
    from verl.utils.config import omega_conf_to_dataclass

    cfg = compose(overrides=_guide_cli())
    told, error = _manager_import(omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout.checkpoint_engine))
    assert error is None and told == [], (told, error)


def test_separate_async_colocated_naive_manager_is_not_warned():
    """In separate_async verl builds the naive manager first (PPOTrainer._setup), then the standalone one with
    reshard: with the trainer's config known (on_import finds the verl trainer object up the stack), the naive
    manager is not worth a warning; in sync it is. Decided on the configs verl composes and sets. (The stack search
    itself is not exercised here: verl 0.9.1's trainer modules do not import in the verl virtualenv, which lacks
    their TransferQueue and cachetools dependencies.)"""
    from reshard.integrations.verl import modes

    cfg, ce = _as_verl_trainer_sets_it(_guide_cli())
    assert modes.not_used_message(ce, cfg) is None
    cfg, ce = _as_verl_trainer_sets_it(_guide_cli(drop=("trainer.v1.",)))
    told = modes.not_used_message(ce, cfg)
    assert told is not None and "trainer_mode=sync" in told and "'naive'" in told, told


def test_a_key_that_reaches_no_backend_fails_the_manager_naming_it():
    """Options put directly under engine_kwargs (not engine_kwargs.reshard): verl would hand reshard `{}`."""
    from verl.utils.config import omega_conf_to_dataclass

    overrides = [o.replace("engine_kwargs.reshard.", "engine_kwargs.") for o in _guide_cli()]
    cfg = compose(overrides=overrides)
    _, error = _manager_import(omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout.checkpoint_engine))
    assert error is not None and "engine_kwargs.model" in str(error) and "engine_kwargs.reshard" in str(error), error
    # and in a worker, where verl builds the engine from engine_kwargs.get("reshard", {})
    from reshard.errors import ArgumentError
    from reshard.integrations.verl.engine import ReshardCheckpointEngine

    with pytest.raises(ArgumentError, match="engine_kwargs.reshard.model"):
        ReshardCheckpointEngine(1 << 20, is_master=True)
