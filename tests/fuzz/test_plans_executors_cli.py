"""Fuzz: saved plans, executor calls and command lines, each broken in one rule of its grammar.

- a plan (dict, .json or .npz): one entry of the header or one integer array given a wrong type, an out-of-range
  value, another length, or removed, with the digest left stale or recomputed as an attacker would; or the file's
  bytes damaged. Loading raises PlanError (a PlanFileError for the file's content), never anything else;
- an executor call: a plan whose ops were tampered with, or tensors missing, of another shape or dtype, not
  contiguous, on the meta device, or sharing memory. The executor raises ExecutionError before any byte moves:
  every destination still holds its sentinel;
- `reshard plan`: one flag with a value of the wrong type or range, an invalid layout string, a model path that
  is not a config. Exit status 2 with one line on stderr naming the flag or the field, no traceback.
"""
from __future__ import annotations

import contextlib
import copy
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

import reshard
from reshard.cli import main
from reshard.errors import ExecutionError, PlanError, ReshardError
from reshard.executors import allocate, shard
from reshard.executors.binding import Binding
from reshard.executors.collective.executor import CollectiveExecutor
from reshard.executors.reference import ReferenceExecutor
from reshard.layouts import layout_from_dict
from reshard.planner import Plan, Program
from reshard.planner.verify import ARRAY_NAMES, _bounds, _program, _table
from harness.hostile import config_documents, invalid_layout_strings

pytestmark = pytest.mark.fuzz
SPEC = reshard.ModelSpec(family="qwen3", hidden_size=16, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=4, intermediate_size=32, vocab_size=40, qk_norm=True, dtype="float32")
PLANS = [reshard.compile(reshard.MegatronLayout(model=SPEC, tp=2), reshard.VllmLayout(model=SPEC, tp=1, replicas=2),
                         fanout=1),
         reshard.compile(reshard.MegatronLayout(model=SPEC, tp=2), reshard.VllmLayout(model=SPEC, tp=2),
                         colocated=True)]
DICTS = [p.to_dict() for p in PLANS]
SENTINEL = -7.0

# --- saved plans --------------------------------------------------------------------------------------------

REQUIRED = ["format", "src", "dst", "digest", "coverage", "colocated", "program", "src_tensors", "dst_tensors",
            "bounds"]
WRONG_ENTRY = {"format": ["2", 1, 3, True, None], "colocated": ["false", 0, None, [1]],
               "fanout": ["1", 1.5, True, 0, -1, 10 ** 9], "roots": ["1", 2.5, False, 0],
               "selection": ["all", [1, 2], [], ["nope"], ["model.norm.weight", "model.norm.weight"]],
               "coverage": ["partial", None, 1], "compile_seconds": ["0.1", -1.0, None, [0]],
               "program": [{"ranks_per_replica": "1", "tensors_per_replica": 3}, [], {"ranks_per_replica": 1}],
               "bounds": [[], {"model_bytes": -1, "lower_bound_by_dst": []}, None],
               "src": [{"kind": "megatron"}, {"kind": "nope"}, [], {"kind": "megatron", "tp": "2", "model": {}}],
               "digest": ["", "ab", 5, "Z" * 64], "src_tensors": [{"rank": [0]}, [], {"rank": [0], "kind": [5],
                                                                                  "kinds": []}],
               "extra": [1]}


def redigest(d: dict) -> None:
    """Give a changed plan the digest of its content, as someone who tampers with it would (if it can be built)."""
    try:
        prog = _program({k: np.asarray(v) for k, v in d["arrays"].items()}, d["program"])
        src, dst = layout_from_dict(d["src"]), layout_from_dict(d["dst"])
        plan = Plan(src=src, dst=dst, src_tensors=_table("src_tensors", d["src_tensors"]),
                    dst_tensors=_table("dst_tensors", d["dst_tensors"]), program=prog,
                    bounds=_bounds(d["bounds"]), colocation=d.get("colocation") or (
                        tuple(range(8)) if d["colocated"] else None), fanout=d["fanout"], roots=d["roots"],
                    selection=d["selection"])
        d["digest"] = plan.digest
    except Exception:  # noqa: BLE001 - content the plan cannot even be built from keeps its stale digest
        pass


def test_redigest_gives_an_intact_plan_its_own_digest():
    """The tamperer's recomputation is the plan's own: an intact plan's digest, blanked, comes back the same (so the
    tampered plans below whose digest is recomputed are refused for their content, not a stale digest)."""
    d = copy.deepcopy(DICTS[0])
    digest, d["digest"] = d["digest"], "0" * 64
    redigest(d)
    assert d["digest"] == digest


@st.composite
def tampered_plans(draw):
    """(plan dict, the entry to blame): one header entry or array broken, digest stale or recomputed."""
    d = copy.deepcopy(draw(st.sampled_from(DICTS)))
    where = draw(st.sampled_from(["entry", "missing", "array"]))
    if where == "missing":
        key = draw(st.sampled_from(REQUIRED))
        del d[key]
    elif where == "entry":
        key = draw(st.sampled_from(sorted(WRONG_ENTRY)))
        d[key] = draw(st.sampled_from(WRONG_ENTRY[key]))
    else:
        key = draw(st.sampled_from(list(ARRAY_NAMES)))
        a = d["arrays"][key]
        flat = a[0] if a and isinstance(a[0], list) else a
        how = draw(st.sampled_from(["big", "negative", "float", "bool", "longer", "shorter", "ragged", "scalar"]))
        if how in ("big", "negative", "bool", "float") and flat:
            i = draw(st.integers(0, len(flat) - 1))
            flat[i] = {"big": 10 ** 15, "negative": -1, "bool": True, "float": flat[i] + 0.5}[how]
            if how == "negative" and key in ("arrays.parent", "parent"):
                flat[i] = 10 ** 15
        elif how == "longer" or (how in ("big", "negative", "bool", "float") and not flat):
            flat.append(draw(st.integers(0, 3)))
        elif how == "shorter":
            assume(flat)
            flat.pop()
        elif how == "ragged":
            d["arrays"][key] = [flat, []] if flat else [[1], []]
        else:
            d["arrays"][key] = 7
        key = f"arrays.{key}"
    if key != "digest" and draw(st.booleans()):
        redigest(d)
    return d, key


@given(tampered_plans())
def test_tampered_plans_are_refused(case):
    d, key = case
    with pytest.raises(PlanError) as info:
        Plan.from_dict(d)
    msg = str(info.value)
    assert "plan" in msg, msg
    field = getattr(info.value, "field", None) or ""
    assert field.startswith(key.split("[")[0]) or field in ("digest", "arrays", "src", "dst", "header") or \
        field.startswith(("arrays.", "dst_tensors", "src_tensors", "bounds", "roots", "program", "colocation")) \
        or key.split(".")[-1] in msg, (key, field, msg[:300])


def test_an_offset_that_wraps_int64_is_refused():
    """A single-row op read from a holder whose row stride is tampered: src_d0 x h_stride = 2**24 x 2**40 = 2**64
    wraps to 0 in int64, so its last element looks inside the tensor; the float bound must see the true offset."""
    d = copy.deepcopy(DICTS[0])
    a = d["arrays"]
    rows = np.asarray(a["t.rows"])
    holder = np.asarray(a["box_hstart"])[np.asarray(a["t.box"])] + np.asarray(a["choice"])[0][np.asarray(a["t.group"])]
    h = next(h for h in sorted(set(holder.tolist())) if (rows[holder == h] == 1).all())  # read by single-row ops only
    op = int(np.flatnonzero(holder == h)[0])
    a["h_stride"][h], a["t.src_d0"][op] = 2 ** 40, 2 ** 24
    redigest(d)
    with pytest.raises(PlanError, match="reads past the end of its source tensor") as info:
        Plan.from_dict(d)
    assert info.value.field == f"arrays.t.src_d0[{op}]"


DAMAGE = st.sampled_from(["truncate", "flip", "prepend", "empty", "garbage", "no header", "object array",
                          "float array", "huge shape"])


@settings(max_examples=60)
@given(DAMAGE, st.integers(0, 10 ** 6), st.booleans())
def test_damaged_plan_files_are_refused(tmp_path_factory, how, where, as_json):
    assume(not as_json or how in ("truncate", "flip", "prepend", "empty", "garbage"))
    tmp = tmp_path_factory.mktemp("plan")
    path = PLANS[0].save(tmp / ("p.json" if as_json else "p.npz"))
    data = path.read_bytes()
    if how == "truncate":
        data = data[: where % max(len(data) - 1, 1)]
    elif how == "flip":
        i = where % len(data)
        data = data[:i] + bytes([data[i] ^ 0x5A]) + data[i + 1:]
    elif how == "prepend":
        data = b"PK\x03\x04garbage" + data
    elif how == "empty":
        data = b""
    elif how == "garbage":
        data = np.random.default_rng(where).bytes(200)
    elif not as_json:  # crafted archives: members a plan never has, or arrays no plan holds
        arrays = {f"a:{k}": v for k, v in PLANS[0].program.arrays().items()}
        arrays["header"] = np.frombuffer(json.dumps(PLANS[0]._meta()).encode(), dtype=np.uint8)
        if how == "no header":
            del arrays["header"]
        elif how == "object array":
            arrays["a:fed"] = np.asarray([{"x": 1}], dtype=object)
        elif how == "float array":
            arrays["a:fed"] = arrays["a:fed"].astype(float)
        buf = io.BytesIO()
        np.savez(buf, **arrays) if how != "object array" else np.savez(buf, allow_pickle=True, **arrays)
        data = buf.getvalue()
        if how == "huge shape":  # a member whose .npy header claims 2**40 elements
            data = data.replace(b"'shape': (", b"'shape': (1099511627776, ", 1)
    path.write_bytes(data)
    try:
        Plan.load(path)
    except PlanError:
        return
    # a zip reads past bytes prepended to it, and a flipped byte in an unused field of its records changes
    # nothing: the content then proves itself like any other plan's
    assert how in ("flip", "prepend") and not as_json, f"{how}: a damaged plan loaded"


# --- executor calls -----------------------------------------------------------------------------------------

EX_PLAN = reshard.compile(reshard.MegatronLayout(model=SPEC, tp=2), reshard.VllmLayout(model=SPEC, tp=2))
WEIGHTS = {t.name: torch.randn(t.shape, generator=torch.Generator().manual_seed(0)) for t in SPEC.tensors}
TEMPLATE = ("dst_offset", "dst_stride", "rows", "cols", "src_d0", "src_d1", "dst_tensor", "dst_rank", "box")


def _tampered(column: str, i: int, value: int) -> Plan:
    p = EX_PLAN.program
    t = {k: np.array(v) for k, v in p.template.items()}
    t[column][i % len(t[column])] = value
    prog = Program(template=t, relay=p.relay, **{n: getattr(p, n) for n in Program.ARRAYS},
                   ranks_per_replica=p.ranks_per_replica, tensors_per_replica=p.tensors_per_replica)
    return Plan(src=EX_PLAN.src, dst=EX_PLAN.dst, src_tensors=EX_PLAN.src_tensors, dst_tensors=EX_PLAN.dst_tensors,
                program=prog, bounds=EX_PLAN.bounds)


@st.composite
def bad_calls(draw):
    """(what makes the plan, src, dst, the destination tensors that must keep their sentinel). A tampered plan
    is refused when it is built (an index out of range) or by the executor (an op outside its tensors)."""
    src, dst = shard(EX_PLAN.src, WEIGHTS), allocate(EX_PLAN.dst, fill=SENTINEL)
    keep = [t for ts in dst.values() for t in ts.values()]
    plan = lambda: EX_PLAN  # noqa: E731
    how = draw(st.sampled_from(["op", "missing", "shape", "dtype", "strided", "meta", "alias", "alias_src",
                                "not_tensor"]))
    r = draw(st.sampled_from(sorted(dst)))
    name = draw(st.sampled_from(sorted(dst[r])))
    t = dst[r][name]
    if how == "op":
        column = draw(st.sampled_from(TEMPLATE))
        # values no op can have (a wide stride is harmless on a one-row block, so strides only shrink)
        values = [-1, 0] if column == "dst_stride" else [-1, 10 ** 9, 2 ** 46] + [0] * (column in ("rows", "cols"))
        value = draw(st.sampled_from(values))
        i = draw(st.integers(0, 10 ** 6))
        assume(int(EX_PLAN.program.template[column][i % len(EX_PLAN.program.template[column])]) != value)
        plan = lambda: _tampered(column, i, value)  # noqa: E731
    elif how == "missing":
        del dst[r][name]
    elif how == "shape":
        dst[r][name] = torch.full((*t.shape[:-1], t.shape[-1] + 1), SENTINEL)
    elif how == "dtype":
        dst[r][name] = t.to(torch.float64)
    elif how == "strided":
        assume(t.dim() == 2 and t.shape[0] > 1 and t.shape[1] > 1)
        dst[r][name] = torch.full(t.shape[::-1], SENTINEL).t()
    elif how == "meta":
        dst[r][name] = torch.empty(t.shape, device="meta")
    elif how == "alias":  # two destination tensors over one buffer
        other = draw(st.sampled_from(sorted(n for n in dst[r] if n != name)))
        big = torch.full((t.numel() + dst[r][other].numel(),), SENTINEL)
        dst[r][name] = big[:t.numel()].view(t.shape)
        dst[r][other] = big[t.numel() // 2: t.numel() // 2 + dst[r][other].numel()].view(dst[r][other].shape)
        keep += [dst[r][name], dst[r][other]]
    elif how == "alias_src":
        s_rank, s_name = next((sr, sn) for sr, ts in src.items() for sn, st_ in ts.items() if st_.numel() >= t.numel())
        dst[r][name] = src[s_rank][s_name].view(-1)[:t.numel()].view(t.shape)
        keep = [x for x in keep if x is not t]
    else:
        dst[r][name] = t.tolist()
    return plan, src, dst, keep


@given(bad_calls(), st.sampled_from(["reference", "collective"]))
def test_bad_executor_calls_move_nothing(call, executor):
    make, src, dst, keep = call
    with pytest.raises((ExecutionError, PlanError)) as info:
        plan = make()
        if executor == "reference":
            ReferenceExecutor(plan, None, 0, src, dst).refit()
        else:  # one process plays every rank (no process group): the same checks as across processes
            CollectiveExecutor(plan, Binding((0, 0), (0, 0)), None, src, dst).refit()
    msg = str(info.value)
    assert "nothing was moved" in msg or "do not match the plan" in msg or "plan file: arrays." in msg, msg
    assert all(bool((t == SENTINEL).all()) for t in keep), "a refused refit wrote a destination"


# --- the command line ---------------------------------------------------------------------------------------

INT_FLAGS = {"--fanout": 1, "--roots": 1, "--relay-cap": 1, "--gpus-per-node": 1, "--dst-first-gpu": 0}
FLOAT_FLAGS = {"--nic-gbps": True, "--nvlink-gbs": True, "--nvlink-bidir-gbs": True, "--copy-tbs": True,
               "--network-latency-us": False, "--nvlink-latency-us": False, "--op-overhead-us": False}


@st.composite
def bad_command_lines(draw, model: str, tmp: str):
    """(argv, the flag or field to blame)."""
    argv = ["plan", "--model", model, "--src", "megatron:tp=2", "--dst", "vllm:tp=2"]
    what = draw(st.sampled_from(["int", "float", "layout", "layers", "colocated", "save", "model", "dtype"]))
    if what == "int":
        flag = draw(st.sampled_from(sorted(INT_FLAGS)))
        value = draw(st.sampled_from(["abc", "٣", "-5", "1.5", "", "99999999999999", "0x2"]
                                     + (["0"] if INT_FLAGS[flag] else [])))
        return argv + ["--predict", flag, value], flag
    if what == "float":
        flag = draw(st.sampled_from(sorted(FLOAT_FLAGS)))
        value = draw(st.sampled_from(["nan", "inf", "-inf", "-1", "abc", "1e10", "1e400"]
                                     + (["0"] if FLOAT_FLAGS[flag] else [])))
        return argv + ["--predict", flag, value], flag
    if what == "layout":
        text, key = draw(invalid_layout_strings())
        side = draw(st.sampled_from(["--src", "--dst"]))
        argv[argv.index(side) + 1] = text
        return argv, key
    if what == "layers":
        return argv + ["--layers", draw(st.sampled_from(["a", "1,,2", "-1", "999", "1.5", "٣", ""]))], "--layers"
    if what == "colocated":
        return argv + ["--colocated", draw(st.sampled_from(["x", "0,9", "0,-1", "0,1,"]))], "--colocated"
    if what == "save":
        return argv + ["--save", draw(st.sampled_from(["/nonexistent/d/p.npz", tmp, f"{tmp}/p.txt"]))], "--save"
    if what == "dtype":
        return argv + ["--dtype", draw(st.sampled_from(["int8", "", "float64", "bf16"]))], "dtype"
    doc, _ = draw(config_documents())
    path = Path(tmp) / f"bad{len(doc)}.json"
    path.write_bytes(doc)
    argv[2] = draw(st.sampled_from([str(path), f"{tmp}/empty", f"{tmp}/none.json"]))
    return argv, "config"


@pytest.fixture(scope="module")
def cli_model(tmp_path_factory) -> tuple[str, str]:
    tmp = tmp_path_factory.mktemp("cli")
    config = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
              "vocab_size": 100}
    (tmp / "config.json").write_text(json.dumps(config))
    (tmp / "empty").mkdir()
    return str(tmp / "config.json"), str(tmp)


@given(data=st.data())
def test_bad_command_lines_exit_2_with_one_line(cli_model, data):
    argv, blame = data.draw(bad_command_lines(*cli_model))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's own refusals
            code = e.code
    lines = [x for x in err.getvalue().splitlines() if x.strip()]
    assert code == 2, (argv, code, err.getvalue())
    assert len(lines) == 1 and lines[0].startswith("reshard") and "Traceback" not in lines[0], err.getvalue()
    assert blame in lines[0], (blame, lines[0])


def test_an_internal_error_keeps_its_traceback(monkeypatch, cli_model):
    """A bug is not an input error: it escapes main (a traceback, exit status 1 from the interpreter)."""
    import reshard.planner.compiler as compiler

    monkeypatch.setattr(compiler, "select_indices", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        main(["plan", "--model", cli_model[0], "--src", "megatron:tp=2", "--dst", "vllm:tp=2"])
    assert not issubclass(ZeroDivisionError, ReshardError)
