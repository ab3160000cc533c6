"""Fixtures of the vLLM tests: tiny HF checkpoints saved by transformers, and the session's vLLM worker worlds.

These tests run in the vLLM virtualenv (scripts/test does it; `-m vllm`): real vLLM model code, weight loaders
and engines on CPU.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("vllm")
    sys.path.insert(0, str(HERE))
    import vllm_harness as harness

    base = tmp_path_factory.mktemp("ckpt")
    return {
        "qwen3": harness.make_checkpoint(base / "qwen3", "qwen3"),
        "qwen3_tied": harness.make_checkpoint(base / "qwen3_tied", "qwen3", tie=True, seed=2),
        "qwen3_mqa": harness.make_checkpoint(base / "qwen3_mqa", "qwen3", seed=4, kv_heads=1),
        "qwen3_moe": harness.make_checkpoint(base / "qwen3_moe", "qwen3_moe", seed=3),
    }


@pytest.fixture(scope="session")
def vllm_worlds(checkpoints, tmp_path_factory, request) -> dict[str, dict[int, list[dict]]]:
    """One world of vLLM worker processes per TP size (one process per rank, vLLM's process groups over gloo, set
    up once) for every module with a `world_jobs` function (test_vllm_install, test_vllm_fp8, test_vllm_checkpoint,
    test_lora_slots): world_checks.py runs their cases one after another, each case on models of its own built
    from its checkpoint (what a case changes, no other case reads). Starting vLLM and its process groups is most of
    a small world's time; one world per TP size for the session, instead of one per module, saves it.

    Only the (world, case) pairs this session's selected tests of those modules use (their `world` and `case`
    parameters) are computed, whatever order pytest runs the tests in: `pytest -k tp1-qwen3` starts one world for
    one case, a module run alone starts worlds for its own cases only, and the AMX re-run of scripts/test pays only
    for the tests it selected. Each case carries the node ids of its tests (per `check` where the test has that
    parameter): the CPU capability checks a case or check consults are logged as that test's (tests/cpu_path), so
    the AMX re-run selects the tests whose checks took that path, not the test that happened to start the world.

    The worlds start vLLM while the modules' `world_jobs` save what their cases read (megatron-core checkpoints,
    peft adapters, FP8 configs), then run the jobs. Returns, per module name, per world, each rank's report of that
    module's cases (or what the module's `world_jobs` raised, a skip included: its tests raise it, the other
    modules' run)."""
    import vllm_harness as harness

    selected: dict = {}  # module -> world -> case -> check ("" without one) -> node id
    for item in request.session.items:
        module = getattr(item, "module", None)
        params = getattr(getattr(item, "callspec", None), "params", {})
        if hasattr(module, "world_jobs") and {"world", "case"} <= set(params):
            cases = selected.setdefault(module, {}).setdefault(params["world"], {})
            cases.setdefault(params["case"], {})[params.get("check", "")] = item.nodeid
    out = tmp_path_factory.mktemp("worlds")
    worlds = sorted({world for cases in selected.values() for world in cases})
    running = {}
    for world in worlds:  # vLLM's import and process groups take a while: the worlds start them first ...
        (out / f"w{world}").mkdir()
        running[world] = harness.launch(sys.executable, HERE / "world_checks.py",
                                        [str(out / f"w{world}"), str(checkpoints["qwen3_moe"])], world, out)
    jobs: dict[int, list[dict]] = {world: [] for world in worlds}
    unready = {}  # module -> what its preparation raised (a skip included): its tests raise it, the others run
    try:  # ... while the modules save the checkpoints and adapters their cases read
        for module, cases_of in selected.items():
            name = Path(module.__file__).stem
            try:
                module_jobs = module.world_jobs(cases_of, checkpoints, out / name)
            except (Exception, pytest.skip.Exception) as e:
                unready[name] = e
                continue
            for world, cases in module_jobs.items():
                jobs[world].extend(dict(c, module=name, tests=cases_of[world][c["name"]]) for c in cases)
    finally:
        for world in worlds:  # each world runs its jobs once they are there (none: it stops)
            harness.write_json(out / f"w{world}" / "jobs.json", jobs[world])
    for procs in running.values():
        harness.wait(procs, timeout=2400)
    ranks = {world: [json.loads((out / f"w{world}" / f"rank{r}.json").read_text()) for r in range(world)]
             for world in worlds}
    modules = {job["module"] for cases in jobs.values() for job in cases}
    return {**{m: {w: [r.get(m, {}) for r in rs] for w, rs in ranks.items()} for m in modules}, **unready}


@pytest.fixture(scope="module")
def reports(vllm_worlds, request) -> dict[int, list[dict]]:
    """The requesting module's reports from the session's worlds (vllm_worlds): per world, each rank's report of
    the module's cases. (Modules that start worlds of their own, the EPLB ones, define their own `reports`.)"""
    got = vllm_worlds.get(Path(request.module.__file__).stem, {})
    if isinstance(got, BaseException):
        raise got
    return got
