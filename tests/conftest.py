import contextlib
import glob
import os
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# The CPU capability path of this session and every process it starts, decided here once (tests/cpu_path).
sys.path.insert(0, str(Path(__file__).resolve().parent / "cpu_path"))
import cpu_path_session  # noqa: E402

# The two-host test bed (network namespaces) of the multihost tests, importable from every stage's tests.
sys.path.insert(0, str(Path(__file__).resolve().parent / "testbed"))
from cpu_path_session import pin, pytest_collection_modifyitems, pytest_runtest_makereport  # noqa: E402,F401 (hooks)

pin()
# The suite's harness (tests/harness, imported as `harness`), importable here and, through PYTHONPATH, in every
# process the suite starts (world processes, servers, Ray workers, processes of the test bed's hosts).
TESTS = str(Path(__file__).resolve().parent)
sys.path.insert(0, TESTS)
if TESTS not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))
# Ray >= 2.50 turns token authentication on for every new local cluster and, when RAY_AUTH_MODE is unset, a joining
# process decides by whether ~/.ray/auth_token existed when *it* started: a trainer process forked from a
# forkserver started before the first cluster then joins without the token and is refused (a fresh CI machine has
# no token file; a developer machine usually does). One mode for every process the suite starts, decided here.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Single-host tests keep their stores and groups on loopback: with nothing set, reshard publishes this host's routable
# address (reshard.addresses), and the suite's traffic stays on addresses of this machine's own. The multihost tests
# (tests/multihost) start their processes in network namespaces without it, where discovery is what they test.
os.environ.setdefault("RESHARD_HOST", "127.0.0.1")
# Start-up work of the suite's vLLM and Ray processes that buys the tests nothing, found by sampling every process's
# CPU time through a whole `.ci/run` (2-core machine, fresh set-up), where the suite is CPU-bound:
# - each process of the GPU build of vLLM (.venv-vllm) imports `humming`, which starts two Python processes in the
#   background to build CUDA kernel launchers; with no CUDA here each fails, after ~3.5 CPU-s (79 of them, ~280
#   CPU-s). HUMMING_DISABLE_PARALLEL_BUILD is humming's own switch for those builds.
# - a new Ray cluster starts idle Python workers with its first driver, for tasks of the job's runtime environment;
#   most of the suite's actors name one of their own (the vLLM virtualenv, PYTHONPATH), so those workers mostly
#   import Ray and wait. Started on demand instead, no worker is started for nothing.
# - vLLM inspects each model class in a subprocess that imports vLLM again: tests/cpu_path/vllm_startup.py runs it in
#   process in every process of the suite (through sitecustomize.py), this one too. Its inspections' answers are
#   cached under a root of the suite's own, one per virtualenv the tests run in (the two vLLM builds have different
#   files under the same cache names).
os.environ.setdefault("HUMMING_DISABLE_PARALLEL_BUILD", "1")
os.environ.setdefault("VLLM_CACHE_ROOT", str(Path.home() / ".cache" / "vllm" / f"tests-{Path(sys.prefix).name}"))
import vllm_startup  # noqa: E402

vllm_startup.install()
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")

# CI runs every property at least 200 examples; locally `HYPOTHESIS_PROFILE=dev` is quicker.
settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=30, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session", autouse=True)
def _sweep_shared_memory_of_dead_processes():
    """Processes the tests kill (fault tests, stopped servers) cannot remove their shared-memory names: after the
    session, remove reshard's segments made during it whose creator (the pid in the name) is gone."""
    start = time.time() - 1
    yield
    from harness.shm import creator_gone

    for path in glob.glob("/dev/shm/reshard-*-*"):
        with contextlib.suppress(OSError):
            if os.stat(path).st_mtime >= start and creator_gone(os.path.basename(path)):
                os.unlink(path)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The CPU capability path of the session, and the number of calls the signature fuzz suite generated
    (tests/fuzz/test_signatures.py)."""
    cpu_path_session.pytest_terminal_summary(terminalreporter)
    calls = getattr(config, "reshard_signature_calls", None)
    if calls is not None:
        terminalreporter.write_line(f"signature fuzz: {calls[0]} generated calls over {calls[1]} entry points")


@pytest.fixture(scope="session")
def two_hosts():
    """Hosts A and B (tests/testbed/two_hosts.py), shared by the session's multihost tests; removed at its end."""
    from two_hosts import TwoHosts

    with TwoHosts() as hosts:
        yield hosts
