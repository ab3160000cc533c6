"""The suite's CPU capability pin (tests/cpu_path) reaches processes the tests start, on both paths, and the AMX
pass's selection follows the consult log."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

import amx_pass
import cpu_path_pin
import cpu_path_session

PROBE = ("import torch, json; print(json.dumps([torch.cpu._is_amx_tile_supported(), "
         "hasattr(torch.ops._C, 'convert_weight_packed') and torch.ops._C.convert_weight_packed("
         "torch.arange(4.).reshape(2, 2)).tolist() if torch.cpu._is_amx_tile_supported() else None]))")


# what a child may do before it imports torch: nothing, or ask whether torch is there (as libraries do, e.g. vLLM's
# and transformers' availability checks): the finder that pins torch on import must not be used up by the question
BEFORE_TORCH = {"nothing": "", "probed": "import importlib.util; importlib.util.find_spec('torch'); "}


def probe(path: str, log: Path, cpu_has_amx: bool, before: str = "") -> list:
    """A child python's answers on `path`, on a CPU that has AMX or not as `cpu_has_amx` says (torch's own probe of
    the CPU answers that), so both kinds of CPU are covered on whichever this machine is."""
    env = dict(os.environ, RESHARD_TEST_CPU_PATH=path, RESHARD_TEST_CPU_PATH_LOG=str(log))
    env.pop("ATEN_CPU_CAPABILITY", None)  # the child gets it from the pin, not from this process
    cpu = (f"import torch; caps = torch.cpu.get_capabilities(); "
           f"torch.cpu.get_capabilities = lambda: dict(caps, amx_tile={cpu_has_amx}); ")
    code = before + cpu + PROBE + "; import os; print(os.environ['ATEN_CPU_CAPABILITY'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout.split("\n")
    assert out[1] == "avx2"
    return json.loads(out[0])


@pytest.mark.parametrize("before", list(BEFORE_TORCH), ids=[f"{k}-before-torch" for k in BEFORE_TORCH])
@pytest.mark.parametrize("cpu_has_amx", [False, True], ids=["cpu-without-amx", "cpu-with-amx"])
def test_child_processes_take_the_pinned_path(tmp_path, cpu_has_amx, before):
    # the session put the pin on PYTHONPATH: a plain child python (no vLLM here: the CUDA-wheel case) obeys it
    assert probe("vector", tmp_path / "v.jsonl", cpu_has_amx, BEFORE_TORCH[before]) == [False, None]
    amx, packed = probe("amx", tmp_path / "a.jsonl", cpu_has_amx, BEFORE_TORCH[before])
    # the stand-in (a same-shape permutation) on either CPU: the CUDA wheel has no packing kernel even where the
    # CPU has AMX
    assert amx is True and packed == [[1.0, 0.0], [3.0, 2.0]]
    for name, forced in (("v.jsonl", False), ("a.jsonl", True)):
        lines = [json.loads(x) for x in (tmp_path / name).read_text().splitlines()]
        assert lines and all(e["amx"] is forced and e["exercised"] for e in lines)
        assert all(e["cpu_has_it"] is cpu_has_amx for e in lines if e["check"] == "_is_amx_tile_supported")
        assert all(e["test"].startswith("tests/unit/test_cpu_path.py::test_child_processes_take_the_pinned_path")
                   for e in lines)


def test_this_session_is_pinned():
    assert os.environ["RESHARD_TEST_CPU_PATH"] in cpu_path_pin.PATHS
    assert str(Path(cpu_path_pin.__file__).parent) in os.environ["PYTHONPATH"].split(os.pathsep)


def consult(test: str, cpu_has_it: bool, native_kernels: bool, check: str = "_is_amx_tile_supported") -> dict:
    return {"test": test, "check": check, "pid": 1, "python": "p", "amx": False,
            "exercised": True, "cpu_has_it": cpu_has_it, "native_kernels": native_kernels}


@pytest.mark.parametrize("cpu_has_amx", [False, True])
def test_amx_pass_selects_tests_that_can_take_the_path(tmp_path, cpu_has_amx):
    log = tmp_path / "log.jsonl"
    entries = [consult("tests/a.py::t1[x]", cpu_has_amx, False),   # CUDA wheel: always forcible
               consult("tests/b.py::t", cpu_has_amx, True),         # vLLM CPU build: only on an AMX CPU
               consult("tests/c.py::t", cpu_has_amx, True), consult("tests/c.py::u", cpu_has_amx, False),
               consult("", cpu_has_amx, False),                     # outside any test: ignored
               consult("tests/d.py::t", cpu_has_amx, False, "_is_avx512_supported")]  # no AMX kernel choice
    log.write_text("".join(json.dumps(e) + "\n" for e in entries))
    run, cannot = amx_pass.plan(str(log))
    if cpu_has_amx:
        assert (run, cannot) == (["tests/a.py::t1[x]", "tests/b.py::t", "tests/c.py::t", "tests/c.py::u"], [])
    else:
        assert (run, cannot) == (["tests/a.py::t1[x]", "tests/c.py::u"], ["tests/b.py::t", "tests/c.py::t"])


@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), min_size=1, max_size=4))
def test_each_choice_keeps_every_value_of_every_parameter(values):
    """The AMX run's reduction: a grid of parametrizations, reduced, still takes every value of every parameter,
    keeps no more runs than the parameters have values in all, and always keeps the first parametrization."""
    import itertools

    grid = [SimpleNamespace(callspec=SimpleNamespace(params={f"p{k}": v for k, v in enumerate(combo)}))
            for combo in itertools.product(*values)]
    kept = cpu_path_session.each_choice(grid)
    assert kept[0] is grid[0] and all(any(k is g for g in grid) for k in kept)
    for k, vals in enumerate(values):
        assert {item.callspec.params[f"p{k}"] for item in kept} == set(vals)
    assert len(kept) <= sum(len(set(v)) for v in values)
