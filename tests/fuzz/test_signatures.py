"""Fuzz: every argument of the public entry points, from their signatures. For each entry point a valid call is
written once; hypothesis then replaces exactly one of its arguments (any parameter of the signature) by a value
of a wrong type or an impossible value -- None, strings, floats, booleans, lists where mappings belong and the
reverse, negative, zero, huge and non-finite numbers, unknown names -- and the call must either be refused with a
ReshardError or be valid (the same call with that value is accepted without coercing it into something else:
checked by the entry point's own rule below). Nothing else may escape: no TypeError, KeyError, AttributeError or
ZeroDivisionError from inside. The number of generated calls is written to the terminal summary (conftest)."""
from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import pytest
import torch
from hypothesis import given, settings, strategies as st

import reshard
from reshard.adapters.refit import RefitSpec
from reshard.adapters.server import VllmServer
from reshard.adapters.trainer import TrainerSession
from reshard.adapters.vllm.lease import parse_grant
from reshard.errors import ReshardError
from reshard.executors import shard
from reshard.executors.rendezvous import Rendezvous
from reshard.testing.megatron_cpu import TinyGPT

pytestmark = pytest.mark.fuzz
CONFIG = TinyGPT().hf_config().to_dict()
SPEC = reshard.ModelSpec.from_hf_config(CONFIG)
SRC = reshard.MegatronLayout(model=SPEC)
DST = reshard.VllmLayout(model=SPEC)
REFIT = RefitSpec.of(SPEC, SRC, DST, install="loader", transport="inprocess")
TENSORS = shard(SRC, {t.name: torch.zeros(t.shape) for t in SPEC.tensors}, ranks=[0])[0]
CALLS = {"n": 0}


class Stranger:
    """An object of no type any argument takes."""

    def __repr__(self) -> str:
        return "Stranger()"


WRONG = st.one_of(
    st.none(), st.booleans(), st.sampled_from([0, -1, -(2 ** 63), 2 ** 63, 10 ** 30]),
    st.sampled_from([0.5, -0.0, 1e300, float("nan"), float("inf"), -float("inf")]),
    st.sampled_from(["", "7", "1.5", "none", "cuda:99", "x" * 300, "../../etc/passwd"]),
    st.sampled_from([[], [1], ["a"], (), {}, {"a": 1}, {1: 2}, b"bytes", set()]),
    st.builds(Stranger))

# entry point -> (its valid keyword arguments, the check of an accepted call: must raise if the value was coerced)
ENTRY: dict[str, tuple[Callable[..., Any], dict[str, Any]]] = {
    "TrainerSession": (TrainerSession, {"refit": REFIT, "process": 0, "tensors": TENSORS, "engines": (),
                                        "trainer_group": None, "rendezvous": None, "host": "127.0.0.1",
                                        "pause": "wait", "timeout": 60.0, "lora_ids": None, "lease": 30.0}),
    "VllmServer": (VllmServer, {"url": "http://127.0.0.1:8000", "timeout": 60.0, "api_key": None}),
    "RefitSpec.of": (RefitSpec.of, {"spec": SPEC, "src": SRC, "dst": DST, "config": None}),
    "Rendezvous": (Rendezvous, {"host": "127.0.0.1", "port": 29500, "refit_id": "abcdef012345",
                                "secret": "0" * 32, "timeout": 60.0}),
    "parse_grant": (lambda body: parse_grant(body), {"body": b'{"holder": "abcdefgh", "ttl": 5}'}),
    "compile_plan": (reshard.compile_plan, {"src": SRC, "dst": DST, "tensors": None, "layers": None, "colocated": False, "fanout": None, "roots": None, "relay_cap": 1}),
    "parse_layout": (reshard.parse_layout, {"text": "vllm:tp=1", "model": SPEC}),
    "ModelSpec.from_hf_config": (reshard.ModelSpec.from_hf_config, {"config": CONFIG, "include_mtp": False}),
}


def _valid(name: str, fn: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """The valid call is accepted (a fuzz case that breaks it tests nothing)."""
    fn(**kwargs)


@pytest.mark.parametrize("name", sorted(ENTRY))
def test_the_valid_call_is_accepted(name):
    fn, kwargs = ENTRY[name]
    _valid(name, fn, kwargs)


def _parameters(name: str) -> list[str]:
    fn, kwargs = ENTRY[name]
    try:
        params = [p for p in inspect.signature(fn).parameters if p not in ("self", "cls")]
    except (TypeError, ValueError):
        params = list(kwargs)
    missing = sorted(set(params) - set(kwargs) - {"fields"})
    assert not missing, f"{name}: the valid call does not name {missing}: add them to ENTRY"
    return [p for p in params if p in kwargs]


@settings(max_examples=300)
@given(data=st.data())
def test_one_wrong_argument_is_refused_with_a_library_error(pytestconfig, data):
    name = data.draw(st.sampled_from(sorted(ENTRY)), label="entry point")
    fn, kwargs = ENTRY[name]
    param = data.draw(st.sampled_from(_parameters(name)), label="parameter")
    value = data.draw(WRONG, label="value")
    call = {**kwargs, param: value}
    CALLS["n"] += 1
    pytestconfig.reshard_signature_calls = (CALLS["n"], len(ENTRY))  # reported in the terminal summary (conftest)
    try:
        fn(**call)
    except ReshardError as e:
        assert str(e), f"{name}({param}={value!r}): an empty message"
        return
    except Exception as e:  # noqa: BLE001 - the point of the test
        pytest.fail(f"{name}({param}={value!r}) escaped as {type(e).__name__}: {e}")
    _accepted_means_valid(name, param, value)


def _accepted_means_valid(name: str, param: str, value: Any) -> None:
    """An accepted value must be one the parameter really takes (nothing coerced)."""
    ok_none = {"TrainerSession": {"engines", "trainer_group", "rendezvous", "pause", "lora_ids", "lease"},
               "VllmServer": {"api_key"}, "RefitSpec.of": {"config"},
               "compile_plan": {"tensors", "layers", "fanout", "roots"}}
    if value is None:
        assert param in ok_none.get(name, set()), f"{name}: {param}=None accepted"
        return
    if isinstance(value, bool) and (name, param) in {("compile_plan", "colocated"),
                                                    ("ModelSpec.from_hf_config", "include_mtp")}:
        return
    if name == "compile_plan" and param in ("tensors", "layers", "colocated"):  # an empty selection
        assert isinstance(value, (list, tuple, set)) and not value, f"compile_plan: {param}={value!r} accepted"
        return
    if name == "compile_plan" and param in ("fanout", "roots", "relay_cap"):
        assert type(value) is int and value >= 1, f"compile_plan: {param}={value!r} accepted"
        return
    if name == "parse_layout" and param == "text":
        assert isinstance(value, str), f"parse_layout: text={value!r} accepted"
        return
    if name == "TrainerSession" and param == "engines":
        assert isinstance(value, (list, tuple)) and not value, f"engines={value!r} accepted"
        return
    if name == "TrainerSession" and param == "lora_ids":
        pytest.fail(f"lora_ids={value!r} accepted without install='lora_slot'")
    if param == "port":  # 0: any free port
        assert isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 65536, f"port={value!r}"
        return
    numeric = {"timeout", "lease"}
    if param in numeric:
        assert isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
            and value > 0, f"{name}: {param}={value!r} accepted"
        return
    if param == "process":  # the plan has one source rank
        assert value == 0 and type(value) is int, f"{name}: process={value!r} accepted"
        return
    if param in ("host", "url", "api_key", "refit_id", "secret", "pause"):
        assert isinstance(value, str) and value, f"{name}: {param}={value!r} accepted"
        return
    pytest.fail(f"{name}: {param}={value!r} accepted")
