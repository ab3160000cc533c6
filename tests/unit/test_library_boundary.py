"""The library boundary's named cases (issue 29, item 5), each beside the signature fuzz (tests/fuzz/
test_signatures.py): pydantic's paths that skip validation, a source tensor that merely broadcasts, JSON documents
whose top level is not an object, an output file whose suffix no writer supports (the same rule in the API and the
CLI)."""
from __future__ import annotations

import json

import pytest
import torch

import reshard
from reshard.arguments import PLOT_SUFFIXES
from reshard.cli import main
from reshard.errors import ArgumentError, LayoutError, ModelConfigError, PlanFileError
from reshard.executors import allocate, execute_local, shard, unshard
from reshard.layouts import read_hf_config
from reshard.planner import Plan
from reshard.testing.megatron_cpu import TinyGPT

CONFIG = TinyGPT().hf_config().to_dict()
SPEC = reshard.ModelSpec.from_hf_config(CONFIG)
SRC = reshard.MegatronLayout(model=SPEC, tp=2)
DST = reshard.VllmLayout(model=SPEC)


# --- pydantic paths --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda: SRC.model_copy(update={"tp": -3}),
    lambda: SRC.model_copy(update={"tp": "2"}),
    lambda: DST.model_copy(update={"vocab_padding": 0}),
    lambda: reshard.MegatronLayout.model_construct(model=SPEC, tp=0),
    lambda: reshard.VllmLayout.model_construct(model=SPEC, tp=1.5),
    lambda: reshard.VllmLayout.model_validate_json(json.dumps({"model": SPEC.model_dump(), "tp": 3})),
], ids=["copy-negative", "copy-string", "copy-padding", "construct-zero", "construct-float", "validate-json"])
def test_a_layout_cannot_be_made_invalid_through_pydantic(make):
    with pytest.raises(LayoutError):
        make()


def test_a_model_spec_cannot_be_made_invalid_through_pydantic():
    with pytest.raises(ModelConfigError, match="hidden_size"):
        SPEC.model_copy(update={"hidden_size": -1})
    with pytest.raises(ModelConfigError, match="num_key_value_heads"):
        reshard.ModelSpec.model_construct(**{**SPEC.model_dump(), "num_key_value_heads": 3})
    with pytest.raises(ArgumentError, match="update"):
        SPEC.model_copy(update={"no_such_field": 1})


def test_fields_cannot_be_set_or_deleted():
    layout = reshard.VllmLayout(model=SPEC)
    with pytest.raises(ArgumentError, match="immutable"):
        layout.tp = 0
    with pytest.raises(ArgumentError, match="immutable"):
        del layout.tp
    with pytest.raises(ArgumentError, match="immutable"):
        SPEC.hidden_size = -1
    assert layout.tp == 1 and SPEC.hidden_size > 0


def test_pydantic_paths_still_make_valid_copies():
    """Re-validation keeps every valid use (the library copies specs with another dtype, layouts with another tp)."""
    assert SPEC.model_copy(update={"dtype": "float32"}).dtype == "float32"
    # the fields given stay; those left to their defaults default again (etp and world derive from the new tp)
    assert SRC.model_copy(update={"tp": 1}) == reshard.MegatronLayout(model=SPEC, tp=1)
    given = reshard.MegatronLayout(model=SPEC, tp=2, world=8)
    assert given.model_copy(update={"tp": 1}) == reshard.MegatronLayout(model=SPEC, tp=1, world=8)
    assert given.model_copy(update={"world": None}) == SRC  # None: the default again
    assert reshard.MegatronLayout.model_construct(model=SPEC, tp=2) == SRC
    assert reshard.ModelSpec.model_validate_json(SPEC.model_dump_json()) == SPEC


# --- no broadcast ----------------------------------------------------------------------------------------------

def test_a_source_tensor_that_merely_broadcasts_is_refused():
    """A (1, hidden) embedding broadcasts to (vocab, hidden): it would fill every row with one row's values."""
    weights = {t.name: torch.randn(t.shape) for t in SPEC.tensors}
    name = next(t.name for t in SPEC.tensors if len(t.shape) == 2 and t.shape[0] > 1)
    weights[name] = weights[name][:1].clone()
    with pytest.raises(ArgumentError, match="canonical shape"):
        shard(SRC, weights)
    weights[name] = torch.randn(1)  # a scalar-like tensor broadcasts to anything
    with pytest.raises(ArgumentError, match=name.replace(".", r"\.")):
        shard(SRC, weights)


def test_a_rank_tensor_of_another_shape_is_refused_by_unshard():
    tensors = shard(SRC, {t.name: torch.randn(t.shape) for t in SPEC.tensors})
    name, t = next(iter(tensors[0].items()))
    tensors[0][name] = t[:1].clone()
    with pytest.raises(ArgumentError, match="do not match the layout"):
        unshard(SRC, tensors)


def test_shard_and_unshard_still_round_trip():
    """The checks refuse only what is wrong: canonical weights come back bit for bit (the reference path)."""
    weights = {t.name: torch.randn(t.shape).to(torch.bfloat16) for t in SPEC.tensors}
    back = unshard(SRC, shard(SRC, weights))
    assert all(torch.equal(back[k], weights[k]) for k in weights)
    dst = allocate(DST)
    execute_local(reshard.compile_plan(SRC, DST), shard(SRC, weights), dst)
    back = unshard(DST, dst)
    assert all(torch.equal(back[k], weights[k]) for k in weights)


@pytest.mark.parametrize("fill,device", [("0", "cpu"), (True, "cpu"), (1e300, "cpu"), (10 ** 30, "cpu"),
                                         (0.0, "cuda:99"), (0.0, "tpu"), (0.0, 3)])
def test_allocate_refuses_unknown_fill_values_and_devices(fill, device):
    with pytest.raises(ArgumentError):
        allocate(DST, fill=fill, device=device)


def test_nan_is_the_poison_fill_of_floating_point_layouts():
    """NaN marks bytes no plan wrote (the validators allocate destinations with it); an integer dtype has no NaN."""
    assert all(torch.isnan(t).all() for ts in allocate(DST, fill=float("nan")).values() for t in ts.values())
    with pytest.raises(ArgumentError):
        allocate(DST.model_copy(update={"dtype": "int32"}), fill=float("nan"))


# --- JSON documents whose top level is not an object -----------------------------------------------------------

@pytest.mark.parametrize("document", ["[1, 2]", '"text"', "null", "3", "true"])
def test_json_documents_whose_top_level_is_not_an_object(tmp_path, document):
    path = tmp_path / "doc.json"
    path.write_text(document)
    with pytest.raises(ModelConfigError, match="JSON object"):
        read_hf_config(path)
    with pytest.raises(PlanFileError, match="JSON object"):
        Plan.load(path)
    with pytest.raises(ModelConfigError):
        reshard.ModelSpec.model_validate_json(document)
    with pytest.raises(LayoutError):
        reshard.VllmLayout.model_validate_json(document)
    with pytest.raises(LayoutError, match="JSON object"):
        reshard.layouts.layout_from_dict(json.loads(document))


# --- output files: the writers' suffixes, one rule for the API and the CLI ------------------------------------

@pytest.mark.parametrize("name", ["plan.txt", "plan", "plan.npy", "plan.json.gz"])
def test_a_plan_file_suffix_no_writer_supports_is_refused(tmp_path, name):
    plan = reshard.compile_plan(SRC, DST)
    with pytest.raises(ArgumentError, match=r"\.npz"):
        plan.save(tmp_path / name)
    assert not (tmp_path / name).exists()
    assert main(["plan", "--model", _config(tmp_path), "--src", "megatron:tp=2", "--dst", "vllm:tp=1",
                 "--save", str(tmp_path / name)]) == 2
    assert not (tmp_path / name).exists()


@pytest.mark.parametrize("name", ["plan.json", "plan.JSON", "plan.npz", "plan.NPZ"])
def test_the_api_and_the_cli_write_the_same_suffixes_the_same_way(tmp_path, name):
    """`--save plan.JSON` and `Plan.save("plan.JSON")` both write JSON (the suffix in any case), and the file loads."""
    plan = reshard.compile_plan(SRC, DST)
    api, cli = tmp_path / "api", tmp_path / "cli"
    api.mkdir(), cli.mkdir()
    plan.save(api / name)
    assert main(["plan", "--model", _config(tmp_path), "--src", "megatron:tp=2", "--dst", "vllm:tp=1",
                 "--save", str(cli / name)]) == 0
    for path in (api / name, cli / name):
        assert (path.read_bytes()[:1] == b"{") == name.lower().endswith(".json")
        assert Plan.load(path).digest == plan.digest


def test_plot_suffixes_are_matplotlib_writers(tmp_path):
    """The CLI refuses a --plot suffix before compiling; every suffix it allows is one matplotlib writes."""
    plt = pytest.importorskip("matplotlib.pyplot")
    fig = plt.figure()
    supported = {"." + k for k in fig.canvas.get_supported_filetypes()}
    plt.close(fig)
    assert set(PLOT_SUFFIXES) <= supported
    assert main(["plan", "--model", _config(tmp_path), "--src", "megatron:tp=2", "--dst", "vllm:tp=1",
                 "--plot", str(tmp_path / "plot.xyz")]) == 2


def _config(tmp_path) -> str:
    path = tmp_path / "config.json"
    if not path.exists():
        path.write_text(json.dumps(CONFIG))
    return str(path)
