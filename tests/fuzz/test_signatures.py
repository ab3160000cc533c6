"""Fuzz: every argument of the public API, from the signatures. The entry points are every name the public modules
export (`__all__` of reshard, reshard.layouts, reshard.planner, reshard.executors, reshard.adapters: a new export
fails `test_every_public_name_is_fuzzed_or_skipped` until it has a valid call here or a reason in SKIPPED) plus a few
public methods and constructors beside them. For each, a valid call is written once; hypothesis then replaces exactly
one of its arguments (any parameter of the signature) by a value of a wrong type or an impossible value -- None,
strings, floats, booleans, lists where mappings belong and the reverse, negative, zero, huge and non-finite numbers,
unknown names, devices and paths -- and the call must either be refused with a ReshardError or be valid (the value is
one the parameter takes without coercion: `_accepted_means_valid`). Nothing else may escape: no TypeError, KeyError,
AttributeError or ZeroDivisionError from inside. The number of generated calls is written to the terminal summary
(conftest)."""
from __future__ import annotations

import atexit
import importlib
import inspect
import math
import shutil
import tempfile
from pathlib import Path
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
from reshard.executors import Binding, ReferenceExecutor, allocate, execute_local, make_executor, shard, unshard
from reshard.adapters.rendezvous import Rendezvous
from reshard.layouts import (ExpertPlacement, HfLayout, MegatronLayout, ModelSpec, VllmLayout, discover,
                             layout_from_dict, layout_to_dict, read_hf_config, spec_from_hf_config)
from reshard.planner import ClusterModel, Plan, compare_with_measurement, format_prediction, predict
from reshard.testing.megatron_cpu import TinyGPT

pytestmark = pytest.mark.fuzz
PUBLIC_MODULES = ("reshard", "reshard.layouts", "reshard.planner", "reshard.executors", "reshard.adapters")
CONFIG = TinyGPT().hf_config().to_dict()
SPEC = reshard.ModelSpec.from_hf_config(CONFIG)
SRC = reshard.MegatronLayout(model=SPEC)
DST = reshard.VllmLayout(model=SPEC)
REFIT = RefitSpec.of(SPEC, SRC, DST, install="loader", transport="inprocess")
WEIGHTS = {t.name: torch.zeros(t.shape) for t in SPEC.tensors}
TENSORS = shard(SRC, WEIGHTS, ranks=[0])[0]
PLAN = reshard.compile_plan(SRC, DST)
PRED = predict(PLAN)
BINDING = Binding.disjoint(1, 1)
SRC_TENSORS, DST_TENSORS = shard(SRC, WEIGHTS), allocate(DST)
FILES = Path(tempfile.mkdtemp(prefix="reshard-fuzz-"))  # plan files the fuzz reads and writes, never the checkout
atexit.register(shutil.rmtree, FILES, True)
PLAN_FILE = PLAN.save(FILES / "plan.npz")
CALLS = {"n": 0}


class Stranger:
    """An object of no type any argument takes."""

    def __repr__(self) -> str:
        return "Stranger()"


WRONG = st.one_of(
    st.none(), st.booleans(), st.sampled_from([0, -1, -(2 ** 63), 2 ** 63, 10 ** 30]),
    st.sampled_from([0.5, -0.0, 1e300, float("nan"), float("inf"), -float("inf")]),
    st.sampled_from(["", "7", "1.5", "none", "cuda:99", "meta", "x" * 300, "../../etc/passwd", "plan.txt",
                     "[1, 2]", '"text"', "null"]),
    st.sampled_from([[], [1], ["a"], (), {}, {"a": 1}, {1: 2}, {0: {"a": 1}}, {0: []}, b"bytes", set()]),
    st.sampled_from([torch.zeros(1), torch.zeros(2, 3), torch.zeros((), dtype=torch.int64)]),
    st.builds(Stranger))


def _spec_fields() -> dict[str, Any]:
    return {k: getattr(SPEC, k) for k in type(SPEC).model_fields}


def _layout_fields(layout) -> dict[str, Any]:
    return {k: getattr(layout, k) for k in type(layout).model_fields}


# entry point -> (the callable, its valid keyword arguments, examples in the ci profile). Examples are spent where
# the parameters are many; every (parameter, kind of wrong value) pair is reachable.
ENTRY: dict[str, tuple[Callable[..., Any], dict[str, Any], int]] = {
    # reshard / reshard.layouts
    "ModelSpec": (ModelSpec, _spec_fields(), 80),
    "MegatronLayout": (MegatronLayout, _layout_fields(SRC), 80),
    "VllmLayout": (VllmLayout, _layout_fields(DST), 50),
    "HfLayout": (HfLayout, {"model": SPEC, "replicas": 1}, 20),
    "compile_plan": (reshard.compile_plan, {"src": SRC, "dst": DST, "tensors": None, "layers": None,
                                            "colocated": False, "fanout": None, "roots": None, "relay_cap": 1,
                                            "expert_copies": True}, 80),
    "parse_layout": (reshard.parse_layout, {"text": "vllm:tp=1", "model": SPEC}, 30),
    "discover": (discover, {"config": CONFIG}, 20),
    "read_hf_config": (read_hf_config, {"config": CONFIG}, 20),
    "spec_from_hf_config": (spec_from_hf_config, {"config": CONFIG, "include_mtp": False}, 20),
    "layout_from_dict": (layout_from_dict, {"data": layout_to_dict(DST)}, 20),
    "layout_to_dict": (layout_to_dict, {"layout": DST}, 20),
    "ModelSpec.from_hf_config": (reshard.ModelSpec.from_hf_config, {"config": CONFIG, "include_mtp": False}, 20),
    # the pydantic paths that skip validation in pydantic itself (reshard's re-validate)
    "ModelSpec.model_validate_json": (lambda json_data: ModelSpec.model_validate_json(json_data),
                                      {"json_data": SPEC.model_dump_json()}, 20),
    "VllmLayout.model_copy": (lambda update, deep: DST.model_copy(update=update, deep=deep),
                              {"update": {"tp": 1}, "deep": False}, 30),
    "MegatronLayout.model_construct": (lambda model, tp, pp: MegatronLayout.model_construct(model=model, tp=tp,
                                                                                            pp=pp),
                                       {"model": SPEC, "tp": 1, "pp": 1}, 30),
    "Layout.rank_tensors": (SRC.rank_tensors, {"rank": 0}, 20),
    "ExpertPlacement": (ExpertPlacement, {"ranks": 1, "logical_experts": 2, "physical_to_logical": ((0, 1, 1),)}, 40),
    "ExpertPlacement.initial": (ExpertPlacement.initial, {"logical_experts": 2, "redundant": 1, "ranks": 1}, 30),
    "ExpertPlacement.from_vllm": (ExpertPlacement.from_vllm, {
        "physical_to_logical": [[0, 1, 1]], "ranks": 1, "logical_experts": 2, "logical_to_physical": [[[0, -1], [1, 2]]],
        "logical_replica_count": [[1, 2]]}, 50),
    # reshard.planner
    "ClusterModel": (ClusterModel, {}, 0),  # every field (filled in below)
    "predict": (predict, {"plan": PLAN, "cluster": None}, 20),
    "format_prediction": (format_prediction, {"pred": PRED}, 10),
    "compare_with_measurement": (compare_with_measurement, {"plan": PLAN, "measured_seconds": 1.0,
                                                            "cluster": None}, 30),
    "Plan.save": (PLAN.save, {"path": FILES / "saved.json"}, 20),
    "Plan.load": (Plan.load, {"path": PLAN_FILE}, 20),
    "Plan.from_dict": (Plan.from_dict, {"d": PLAN.to_dict()}, 20),
    # reshard.executors
    "Binding": (Binding, {"src": (0,), "dst": (1,)}, 20),
    "ReferenceExecutor": (ReferenceExecutor, {"plan": PLAN, "binding": None, "process": 0, "src": SRC_TENSORS,
                                      "dst": DST_TENSORS}, 40),
    "make_executor": (make_executor, {"name": "reference", "plan": PLAN, "binding": BINDING, "process": 0,
                                      "src": SRC_TENSORS, "dst": DST_TENSORS}, 50),
    "execute_local": (execute_local, {"plan": PLAN, "src": SRC_TENSORS, "dst": DST_TENSORS}, 30),
    "allocate": (allocate, {"layout": DST, "fill": 0.0, "ranks": None, "device": "cpu"}, 40),
    "shard": (shard, {"layout": SRC, "weights": WEIGHTS, "fill": 0.0, "ranks": None}, 40),
    "unshard": (unshard, {"layout": SRC, "tensors": SRC_TENSORS}, 20),
    # reshard.adapters
    "RefitSpec": (RefitSpec, {**{k: getattr(REFIT, k) for k in REFIT.__dataclass_fields__}}, 80),
    "RefitSpec.of": (RefitSpec.of, {"spec": SPEC, "src": SRC, "dst": DST, "config": None}, 30),
    "TrainerSession": (TrainerSession, {"refit": REFIT, "process": 0, "tensors": TENSORS, "engines": (),
                                        "trainer_group": None, "rendezvous": None, "host": "127.0.0.1",
                                        "pause": "wait", "timeout": 60.0, "lora_ids": None, "lease": 30.0,
                                        "pause_for": "refit"}, 80),
    "VllmServer": (VllmServer, {"url": "http://127.0.0.1:8000", "timeout": 60.0, "api_key": None}, 20),
    # beside them: the rendezvous and the engine's lease grant parser
    "Rendezvous": (Rendezvous, {"host": "127.0.0.1", "port": 29500, "refit_id": "abcdef012345",
                                "secret": "0" * 32, "timeout": 60.0}, 30),
    "parse_grant": (lambda body: parse_grant(body), {"body": b'{"holder": "abcdefgh", "ttl": 5}'}, 10),
}
_CLUSTER_MODEL = {k: getattr(ClusterModel(), k) for k in ClusterModel.__dataclass_fields__}
ENTRY["ClusterModel"] = (ClusterModel, _CLUSTER_MODEL, 80)
# the same object exported twice, or under a second name
ALIASES = {"compile": "compile_plan"}

# public names not fuzzed here, with the reason
SKIPPED = {
    "Layout": "the abstract base class of the layouts (each concrete one is fuzzed)",
    "ModelFamily": "the base class a family file subclasses (a declaration, not a call)",
    "Role": "an Enum (Role(x) is Python's own lookup)",
    "registered_layouts": "takes no argument",
    "register_layout": "a registration (a Layout class by its engine: refused unless it names one)",
    "register_cuts": "a registration (an engine's rule for a family's cuts, stored as given)",
    "OP_COLUMNS": "a constant (the op table's column names)",
    "RankTensors": "a type alias",
    "registered_families": "takes no argument",
    "supported_architectures": "takes no argument",
    "Executor": "the abstract base class of the executors (make_executor and ReferenceExecutor are fuzzed)",
    "Placement": "a record the layouts return (read-only output, not an input)",
    "TensorSpec": "a record ModelSpec.tensors returns (read-only output, not an input)",
    "Accounting": "a record Plan.accounting returns (read-only output)",
    "Bounds": "a record inside a Plan (built by the compiler; a loaded plan is checked by Plan.load / from_dict)",
    "Prediction": "a record predict returns (read-only output)",
    "Program": "a plan's op program (built by the compiler; a loaded one is checked by Plan.load / from_dict)",
    "TensorTable": "a plan's tensor table (built by the compiler; a loaded one is checked by Plan.load / from_dict)",
    "Transfer": "a record Plan.transfers returns (read-only output)",
    "Plan": "built by compile_plan, Plan.load or Plan.from_dict (each fuzzed), never by its dataclass constructor",
    "RefitStats": "a record every executor's refit returns (read-only output)",
    "register_family": "changes the process-wide registry (tests/unit/test_family_plugin.py: a class is registered, "
                       "anything else refused with ArgumentError)",
    "CollectiveExecutor": "needs a live torch.distributed group or store (tests/fuzz/test_plans_executors_cli.py "
                           "feeds it wrong options inside real gloo groups)",
    "execute_collective": "needs a live torch.distributed group (as CollectiveExecutor)",
}
EXCEPTIONS = "exception classes (constructing one with any message is fine)"


def _public_names() -> dict[str, Any]:
    out = {}
    for module in PUBLIC_MODULES:
        mod = importlib.import_module(module)
        for name in mod.__all__:
            out[name] = getattr(mod, name)
    return out


def test_every_public_name_is_fuzzed_or_skipped():
    """New public API is covered automatically: every name in the public modules' `__all__` has an entry point
    here (a valid call), an alias of one, or a reason in SKIPPED."""
    missing = sorted(n for n, obj in _public_names().items()
                     if not (isinstance(obj, type) and issubclass(obj, BaseException))
                     and n not in ENTRY and n not in ALIASES and n not in SKIPPED)
    assert not missing, f"public names with neither a valid call in ENTRY nor a reason in SKIPPED: {missing}"
    for alias, name in ALIASES.items():
        assert _public_names()[alias] is ENTRY[name][0], alias


@pytest.mark.parametrize("name", sorted(ENTRY))
def test_the_valid_call_is_accepted(name):
    fn, kwargs, _ = ENTRY[name]
    fn(**kwargs)


def _parameters(name: str) -> list[str]:
    fn, kwargs, _ = ENTRY[name]
    try:
        params = [p.name for p in inspect.signature(fn).parameters.values()
                  if p.name not in ("self", "cls") and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    except (TypeError, ValueError):
        params = list(kwargs)
    missing = sorted(set(params) - set(kwargs) - {"fields"})
    assert not missing, f"{name}: the valid call does not name {missing}: add them to ENTRY"
    return [p for p in params if p in kwargs]


def _fuzz(pytestconfig, name: str, data) -> None:
    fn, kwargs, _ = ENTRY[name]
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


def _examples(name: str) -> int:
    """The entry point's examples: its budget in ENTRY under the ci profile, scaled to the profile's default."""
    from hypothesis import settings as current

    scale = current.default.max_examples / 200
    return max(3, round(ENTRY[name][2] * scale))


@pytest.mark.parametrize("name", sorted(ENTRY))
def test_one_wrong_argument_is_refused_with_a_library_error(pytestconfig, name):
    settings(max_examples=_examples(name))(given(data=st.data())(
        lambda data: _fuzz(pytestconfig, name, data)))()


def _annotation(name: str, param: str) -> tuple[str, Any]:
    """The parameter's annotation as text, and its default."""
    fn = ENTRY[name][0]
    p = inspect.signature(fn).parameters[param]
    ann = p.annotation
    text = ann if isinstance(ann, str) else getattr(ann, "__name__", None) if isinstance(ann, type) else repr(ann)
    return str(text).replace("typing.", ""), p.default


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_fill(value: Any) -> bool:
    """A fill: a real number; NaN and infinities too (the poison fill; the fuzzed layouts are floating-point)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# (entry point, parameter) -> the rule an accepted value must meet, where the annotation alone does not say it
RULES: dict[tuple[str, str], Callable[[Any], bool]] = {
    ("compile_plan", "tensors"): lambda v: isinstance(v, (list, tuple, set)) and not v,  # an empty selection
    ("compile_plan", "layers"): lambda v: isinstance(v, (list, tuple, set)) and all(
        _is_int(x) and 0 <= x < SPEC.num_layers for x in v),
    ("compile_plan", "colocated"): lambda v: isinstance(v, bool),
    ("compile_plan", "expert_copies"): lambda v: isinstance(v, bool),
    ("compile_plan", "fanout"): lambda v: _is_int(v) and v >= 1,
    ("compile_plan", "roots"): lambda v: _is_int(v) and v >= 1,
    ("compile_plan", "relay_cap"): lambda v: _is_int(v) and v >= 1,
    ("TrainerSession", "engines"): lambda v: isinstance(v, (list, tuple)) and not v,
    ("TrainerSession", "lora_ids"): lambda v: False,  # without install='lora_slot'
    ("TrainerSession", "process"): lambda v: _is_int(v) and v == 0,  # the plan has one source rank
    ("Rendezvous", "port"): lambda v: _is_int(v) and 0 <= v < 65536,  # 0: any free port
    ("ReferenceExecutor", "process"): lambda v: _is_int(v) and v >= 0,  # protocol argument, unused
    ("Layout.rank_tensors", "rank"): lambda v: _is_int(v) and v == 0,
    ("allocate", "ranks"): lambda v: isinstance(v, (list, tuple, set)),  # [] or [0]: ranks of the layout
    ("shard", "ranks"): lambda v: isinstance(v, (list, tuple, set)),
    ("allocate", "device"): lambda v: v in ("cpu", "meta"),
    ("Plan.save", "path"): lambda v: isinstance(v, str) and v.endswith((".json", ".npz")),
    ("VllmLayout.model_copy", "deep"): lambda v: isinstance(v, bool),
    ("VllmLayout.model_copy", "update"): lambda v: v == {} or v is None,
    ("RefitSpec", "options"): lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v),
    ("RefitSpec", "verify_layers"): lambda v: isinstance(v, (list, tuple)) and all(_is_int(x) for x in v),
    ("RefitSpec", "plan_digest"): lambda v: isinstance(v, str),  # "": not pinned
    ("make_executor", "binding"): lambda v: v is None,
    # an empty mapping: a process that plays no rank of that side (its tensors are checked against the plan)
    ("ReferenceExecutor", "dst"): lambda v: v == {},
    ("make_executor", "dst"): lambda v: v == {},
    ("unshard", "tensors"): lambda v: v == {},
    ("TrainerSession", "tensors"): lambda v: v == {},  # refused by init(), against the plan
    ("Binding", "src"): lambda v: isinstance(v, (list, tuple)) and v and all(_is_int(x) and x >= 0 for x in v),
    ("Binding", "dst"): lambda v: isinstance(v, (list, tuple)) and v and all(_is_int(x) and x >= 0 for x in v),
    # family facts by name (the families do not declare the names they read: an unknown one is kept, unread)
    ("ModelSpec", "arch"): lambda v: isinstance(v, (dict, list, tuple)) and all(isinstance(k, str) for k in (
        v if isinstance(v, dict) else ())) and (isinstance(v, dict) or not v),
    ("ModelSpec", "dense_layers"): lambda v: isinstance(v, (list, tuple, set)) and all(_is_int(x) for x in v),
    ("RefitSpec", "math"): lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v),
    ("ClusterModel", "src_gpus"): lambda v: isinstance(v, (list, tuple)) and all(_is_int(x) and x >= 0 for x in v),
    ("ClusterModel", "dst_gpus"): lambda v: isinstance(v, (list, tuple)) and all(_is_int(x) and x >= 0 for x in v),
    ("allocate", "fill"): _is_fill,
    ("shard", "fill"): _is_fill,
    ("read_hf_config", "config"): lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v),
    **{("ClusterModel", k): lambda v: _is_number(v) and v >= 0 for k in (
        "nvlink_latency", "network_latency", "copy_latency", "op_overhead", "pack_copies", "commit_copies")},  # the local executor runs every rank in this process
    ("ReferenceExecutor", "binding"): lambda v: v is None,
    ("ExpertPlacement.initial", "ranks"): lambda v: v == 1,  # 1: the placement's three slots on one rank
    ("ExpertPlacement.initial", "redundant"): lambda v: _is_int(v) and v >= 0,
}


def _accepted_means_valid(name: str, param: str, value: Any) -> None:
    """An accepted value must be one the parameter really takes (nothing coerced): the rule in RULES, else the one
    the annotation says (None only where it is optional; ints, numbers and bools of their own type, finite and
    positive; non-empty strings)."""
    ann, default = _annotation(name, param)
    rule = RULES.get((name, param))
    if rule is not None:
        assert (value is None and ("None" in ann or "Optional" in ann)) or rule(value), \
            f"{name}: {param}={value!r} accepted"
        return
    if value is None:
        assert "None" in ann or "Optional" in ann or (default is None and ann in ("", "_empty", "Any", "object")), \
            f"{name}: {param}=None accepted (annotation {ann})"
        return
    base = ann.replace("Annotated[", "").replace("Optional[", "").split("|")[0].split(",")[0].strip(" ]'\"")
    if base == "bool":
        ok = isinstance(value, bool)
    elif base == "int":
        ok = _is_int(value) and value >= 0
    elif base == "float":
        ok = _is_number(value) and value > 0
    elif base == "str":
        ok = isinstance(value, str) and bool(value)
    else:
        ok = False
    assert ok, f"{name}: {param}={value!r} accepted (annotation {ann})"

