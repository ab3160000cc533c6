"""The test suite's own harness (not part of the package): servers, trainer and rollout jobs, fault injection,
reference implementations and benchmark baselines. Imported as `harness.<module>` with tests/ on the import path:
tests/conftest.py puts it on sys.path and PYTHONPATH (so every process the suite starts finds it), benchmarks
through benchmarks/_harness_path.py; a process started with an environment of its own takes `pythonpath()`."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def pythonpath(existing: str | None = None) -> str:
    """PYTHONPATH for a child process that must import this checkout's reshard and the harness: the checkout and
    tests/ ahead of `existing`."""
    return os.pathsep.join(dict.fromkeys(filter(None, [str(ROOT), str(TESTS), *(existing or "").split(os.pathsep)])))
