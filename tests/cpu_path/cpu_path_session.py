"""The pytest side of the CPU capability pin (cpu_path_pin.py): the test session pins itself and every process it
starts, turns a pass that rested on a path this CPU cannot run into a skip that says so, and reports the path."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import cpu_path_pin

HERE = Path(__file__).resolve().parent
DESCRIPTIONS = {"vector": "torch.cpu's AMX / AVX-512 checks answer False (the vector path)",
                "amx": "torch.cpu's AMX / AVX-512 checks answer True (the AMX path; a stand-in packing kernel "
                       "where vLLM lacks it)"}


def pin() -> str:
    """Pin this process and, through PYTHONPATH (sitecustomize.py), every process started from it."""
    os.environ.setdefault(cpu_path_pin.PATH_ENV, "vector")
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(HERE) not in entries:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), *entries])
    cpu_path_pin.install()
    return os.environ[cpu_path_pin.PATH_ENV]


def read_log(log: str | None) -> list[dict]:
    if not log or not os.path.exists(log):
        return []
    with open(log) as f:
        return [json.loads(line) for line in f if line.strip()]


SELECT_ENV = "RESHARD_TEST_CPU_PATH_SELECT"


def each_choice(items: list) -> list:
    """The items (parametrizations of one test function) that together take every value of every parameter at
    least once -- the each-choice criterion of combinatorial testing: a test of 9 cases x 6 models x 2 TP sizes
    keeps about 9 runs, not 108. Greedy, in collection order; deterministic."""
    seen: set[tuple[str, str]] = set()
    kept = []
    for item in items:
        spec = getattr(item, "callspec", None)
        choices = {(k, repr(v)) for k, v in spec.params.items()} if spec is not None else {("", "")}
        if not choices <= seen:
            kept.append(item)
            seen |= choices
    return kept


def pytest_collection_modifyitems(config, items):
    """With $RESHARD_TEST_CPU_PATH_SELECT (a file of test ids, one per line: the AMX run of scripts/test), keep
    those tests, reduced to an each-choice cover of each test function's parametrizations."""
    select = os.environ.get(SELECT_ENV)
    if not select:
        return
    wanted = set(Path(select).read_text().split("\n")) - {""}
    functions: dict[tuple[str, str], list] = {}
    for item in items:
        if item.nodeid in wanted:
            functions.setdefault((item.path.as_posix(), getattr(item, "originalname", item.name)), []).append(item)
    kept = {id(i) for group in functions.values() for i in each_choice(group)}
    config.hook.pytest_deselected(items=[i for i in items if id(i) not in kept])
    items[:] = [i for i in items if id(i) in kept]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On the AMX path, a passing test where some process could not take that path (the vLLM CPU build's real AMX
    kernels on a CPU without AMX) did not test it: report it skipped, by name, not passed."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.passed or os.environ.get(cpu_path_pin.PATH_ENV) != "amx":
        return
    missed = {e["python"] for e in read_log(os.environ.get(cpu_path_pin.LOG_ENV))
              if not e["exercised"] and e["test"] == item.nodeid}
    if missed:
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0,
                           "Skipped: the AMX path could not be exercised on this CPU (no AMX) in processes of "
                           f"{', '.join(sorted(missed))} (the vLLM CPU build's real AMX kernels)")


def pytest_terminal_summary(terminalreporter):
    path = os.environ.get(cpu_path_pin.PATH_ENV, "unpinned")
    entries = read_log(os.environ.get(cpu_path_pin.LOG_ENV))
    tests = {e["test"] for e in entries if e["test"]}
    missed = {e["test"] for e in entries if e["test"] and not e["exercised"]}
    line = f"CPU capability path: {path}: {DESCRIPTIONS.get(path, '?')}; ATen and oneDNN capped at AVX2."
    if entries:
        line += (f" CPU checks consulted {len(entries)} times in {len({e['pid'] for e in entries})} "
                 f"processes by {len(tests)} tests")
        line += f", not exercisable on this CPU in {len(missed)}" if missed else ""
    terminalreporter.write_line(line)
