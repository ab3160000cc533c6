"""The verl tests run in the verl virtualenv (scripts/test's verl stage, `-m verl`); elsewhere they are not
collected (verl pins another transformers than the core virtualenv). In the verl stage a missing verl fails the
run: it collects nothing and pytest exits 5. Whether verl is installed is asked of the installed distributions:
a module lookup would find this very folder (named verl) as a namespace package.

The single-host tests that refit over Ray (test_verl_backend.py, test_verl_exporter_streams.py,
test_verl_guide.py) share one local Ray cluster, `ray_runtime`, and the backend's and the guide's tests one set
of workers over a megatron-core MoE, `megatron_refit`, each module starting from `Refit.reset` (a dead worker's side
started anew, no fault injected, every engine made anew from the module's config). Both are started by the first
test that needs them, in whatever order the modules run, and stopped at the session's end. test_verl_example.py's
script and test_verl_multihost.py's driver start or join clusters of their own, in other processes."""
import importlib.metadata

import pytest


def _verl_installed() -> bool:
    try:
        importlib.metadata.version("verl")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


collect_ignore_glob = [] if _verl_installed() else ["test_*.py"]


@pytest.fixture(scope="session")
def ray_runtime():
    """The session's local Ray cluster (harness.verl_cpu.start_ray)."""
    import ray

    from harness import verl_cpu as vc

    vc.start_ray()
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def megatron_refit(ray_runtime, tmp_path_factory):
    """2 trainer workers (a megatron-core MoE, harness.verl_cpu.MOE) and 3 rollout workers serving transformers'
    checkpoint of it, with verl's manager; its users start from `reset(their config)`."""
    from harness import verl_cpu as vc

    checkpoint = str(vc.save_checkpoint(vc.MOE, tmp_path_factory.mktemp("verl") / "checkpoint"))
    refit = vc.Refit(2, 3, checkpoint, vc.checkpoint_engine_config(checkpoint, 1))
    yield refit
    refit.shutdown()
