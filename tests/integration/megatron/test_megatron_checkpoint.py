"""Megatron torch_dist checkpoints as a refit source, against checkpoints saved by real megatron-core on CPU.

Per layout, megatron-core's `dist_checkpointing.save` writes a checkpoint from gloo ranks (harness.
megatron_ckpt.save_job). The reference is independent of the code under test: megatron-core's own
`dist_checkpointing.load` reads it into a TP=1 model built from another seed, and reshard's live-model adapter
refits that model into HF tensors. The checkpoint source must give the same bytes, read lazily: two reader
processes together read each record about once, a subset plan only the records of what it moves. Broken
checkpoints (truncated or missing shard files, torn records, hostile or inconsistent metadata, a config that
disagrees) are refused with a CheckpointError / LayoutMismatchError before any destination file is written.
"""
from __future__ import annotations

import json
import pickle
import shutil
from dataclasses import dataclass, replace

import pytest
import torch
from safetensors.torch import load_file

from reshard.adapters.megatron.checkpoint import CheckpointError, open_checkpoint
from reshard.adapters.megatron.checkpoint_layout import checkpoint_layout, checkpoint_tensors, export_hf, saved_facts
from reshard.cli import main as cli
from reshard.errors import LayoutMismatchError
from harness.megatron_ckpt import reader_job, reference_job, save_job
from reshard.testing.megatron_cpu import TinyGPT, run_ranks

pytestmark = pytest.mark.megatron

DENSE = TinyGPT()
MOE = TinyGPT(num_experts=4)


@dataclass(frozen=True)
class Case:
    tiny: TinyGPT
    world: int
    sizes: tuple[tuple[str, int], ...]
    saved_tp: int
    saved_etp: int | None = None


CASES = {
    "dense_tp2": Case(DENSE, 2, (("tp", 2),), saved_tp=2),
    "dense_pp2_vpp2_tied": Case(replace(DENSE, tied=True), 2, (("pp", 2), ("vpp", 2)), saved_tp=1),
    "dense_pp2_uneven": Case(replace(DENSE, num_layers=5, first_stage_layers=2), 2, (("pp", 2),), saved_tp=1),
    # expert parallel with expert tensor parallel, and data-parallel replicas of the dense part (dp=2)
    "moe_tp2_ep2_etp2": Case(MOE, 4, (("tp", 2), ("ep", 2), ("etp", 2)), saved_tp=2, saved_etp=2),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Saves (and loads as the reference) each case's checkpoint once per module, when a test first asks."""
    done = {}

    def get(name: str):
        if name not in done:
            case = CASES[name]
            root = tmp_path_factory.mktemp(name)
            ckpt, ref = root / "ckpt", root / "ref"
            ckpt.mkdir()
            ref.mkdir()
            run_ranks(case.world, save_job, case.tiny, dict(case.sizes), str(ckpt), errdir=str(root), timeout=300)
            run_ranks(1, reference_job, case.tiny, str(ckpt), str(ref), errdir=str(root), timeout=300)
            done[name] = case, ckpt, ref
        return done[name]

    return get


@pytest.fixture(params=sorted(CASES))
def saved(request, checkpoints):
    return checkpoints(request.param)


def _same_bytes(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    problems = sorted(set(got) ^ set(want))
    for name in set(got) & set(want):
        a, b = got[name], want[name]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            problems.append(f"{name}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
    return problems


def test_export_equals_megatron_loader(saved, tmp_path):
    case, ckpt, ref = saved
    facts = saved_facts(open_checkpoint(ckpt))
    assert (facts.tp, facts.etp, facts.num_layers, facts.tied) == (
        case.saved_tp, case.saved_etp, case.tiny.num_layers, case.tiny.tied)
    report = export_hf(ckpt, ref, tmp_path / "hf", dtype="float32")
    assert _same_bytes(load_file(tmp_path / "hf" / "model.safetensors"),
                       load_file(ref / "reference.safetensors")) == []
    data = open_checkpoint(ckpt).nbytes
    assert data < report.bytes_read < report.checkpoint_bytes  # the data, and each record's zip directory once
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads((ref / "config.json").read_text())


def test_two_reader_processes_each_read_their_part(saved, tmp_path):
    case, ckpt, ref = saved
    run_ranks(2, reader_job, str(ckpt), str(ref), str(tmp_path), "float32", errdir=str(tmp_path), timeout=300)
    assert _same_bytes(load_file(tmp_path / "readers.safetensors"), load_file(ref / "reference.safetensors")) == []
    total = open_checkpoint(ckpt).record_bytes
    read = [json.loads((tmp_path / f"reader{r}.json").read_text())["bytes_read"] for r in range(2)]
    assert all(0 < b < 0.75 * total for b in read), (read, total)
    assert sum(read) < total, (read, total)  # the readers' byte ranges do not overlap


def test_subset_plan_reads_only_its_records(saved):
    case, ckpt, ref = saved
    from reshard.layouts import HfLayout, ModelSpec
    from reshard.planner import compile_plan

    spec = ModelSpec(**{**ModelSpec.from_hf_config(str(ref / "config.json")).model_dump(), "dtype": "float32"})
    reader = open_checkpoint(ckpt)
    layout = checkpoint_layout(reader, spec)
    plan = compile_plan(layout, HfLayout(model=spec), layers=[1])
    tensors = checkpoint_tensors(reader, plan, 0)
    layer1 = sum(c.length for key, t in reader.tensors.items() if key.startswith("decoder.layers.")
                 for c in t.chunks if c.offsets[0] == 1)
    assert 0 < reader.bytes_read <= layer1  # the layer's records, and none of the others
    assert tensors and all(name.startswith("decoder.layers.1.") for name in tensors)


# --- refusals, on copies of one checkpoint ------------------------------------------------------------------

@pytest.fixture()
def dense(checkpoints, tmp_path):
    """A copy of the dense_tp2 checkpoint to break, and its reference directory (HF config)."""
    _, ckpt, ref = checkpoints("dense_tp2")
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    return copy, ref


def _problems(exc: pytest.ExceptionInfo) -> str:
    return "\n".join(exc.value.problems)


def test_truncated_and_missing_shard_files_are_refused(dense, tmp_path):
    ckpt, ref = dense
    shard = ckpt / "__1_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    with pytest.raises(CheckpointError) as exc:
        open_checkpoint(ckpt)
    assert "truncated file" in _problems(exc) and "__1_0.distcp" in _problems(exc)
    shard.unlink()
    with pytest.raises(CheckpointError) as exc:
        export_hf(ckpt, ref, tmp_path / "out", dtype="float32")
    assert "missing shard file" in _problems(exc)
    assert not (tmp_path / "out").exists()


def test_torn_record_is_refused_before_anything_is_written(dense, tmp_path):
    ckpt, ref = dense
    reader = open_checkpoint(ckpt)
    chunk = reader.tensors["decoder.layers.self_attention.linear_qkv.weight"].chunks[-1]
    shard = ckpt / chunk.file
    data = bytearray(shard.read_bytes())
    data[chunk.offset:chunk.offset + 64] = b"\0" * 64  # the zip header of the record
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as exc:
        export_hf(ckpt, ref, tmp_path / "out", dtype="float32")
    assert "is not a tensor torch can load" in _problems(exc)
    assert not (tmp_path / "out").exists()


def _rewrite_metadata(ckpt, change) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(ckpt)).read_metadata()  # the test's own copy: trusted here
    change(metadata)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))


def test_metadata_with_a_hole_or_an_overlap_is_refused(dense):
    ckpt, _ = dense
    key = "embedding.word_embeddings.weight"

    def drop_chunk(md):
        md.state_dict_metadata[key].chunks.pop()
        md.state_dict_metadata["output_layer.weight"].chunks[0].sizes = torch.Size([128, 64])  # overlaps chunk 1

    _rewrite_metadata(ckpt, drop_chunk)
    with pytest.raises(CheckpointError) as exc:
        open_checkpoint(ckpt)
    text = _problems(exc)
    assert f"{key}: its chunks write 0 cells of the chunk grid more than once and leave 1 slices partly" in text
    assert "output_layer.weight: chunk 0" in text or "output_layer.weight: its chunks" in text



def test_a_layer_missing_from_the_checkpoint_is_refused_by_the_layout_check(dense):
    ckpt, ref = dense
    key = "decoder.layers.self_attention.q_layernorm.weight"

    def drop_layer(md):  # a whole layer of a stacked tensor: how megatron saves a tensor only some layers have
        md.state_dict_metadata[key].chunks = [c for c in md.state_dict_metadata[key].chunks if c.offsets[0] != 3]

    _rewrite_metadata(ckpt, drop_layer)
    from reshard.layouts import ModelSpec

    reader = open_checkpoint(ckpt)  # a whole missing layer is a valid stacked tensor
    spec = ModelSpec(**{**ModelSpec.from_hf_config(str(ref / "config.json")).model_dump(), "dtype": "float32"})
    with pytest.raises(LayoutMismatchError) as exc:
        checkpoint_layout(reader, spec)
    assert f"decoder.layers.3.self_attention.q_layernorm.weight: the checkpoint's {key} does not hold (3,)" \
        in _problems(exc)
    with pytest.raises(CheckpointError, match="is not saved whole"):
        reader.read(key, (3, 0), (1, 32))
    assert reader.bytes_read == 0


def test_metadata_without_a_storage_entry_is_refused(dense):
    ckpt, _ = dense

    def drop_entry(md):
        entry = next(i for i in md.storage_data if i.fqn == "decoder.final_layernorm.weight")
        del md.storage_data[entry]

    _rewrite_metadata(ckpt, drop_entry)
    with pytest.raises(CheckpointError) as exc:
        open_checkpoint(ckpt)
    assert "decoder.final_layernorm.weight: chunk 0 at (0,) has no storage entry" in _problems(exc)


class _Boom:
    def __reduce__(self):
        return (print, ("hostile metadata ran code",))


def test_hostile_metadata_runs_no_code(dense, capsys):
    ckpt, _ = dense
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(CheckpointError) as exc:
        open_checkpoint(ckpt)
    assert "builtins.print is not a torch.distributed.checkpoint metadata class" in _problems(exc)
    assert "hostile" not in capsys.readouterr().out
    (ckpt / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(CheckpointError, match="does not hold torch.distributed.checkpoint Metadata"):
        open_checkpoint(ckpt)


def test_config_that_disagrees_is_refused_naming_every_problem(dense, tmp_path):
    ckpt, ref = dense
    config = json.loads((ref / "config.json").read_text())
    config.update(num_hidden_layers=3, intermediate_size=128, tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    reader = open_checkpoint(ckpt)
    with pytest.raises(LayoutMismatchError) as exc:
        export_hf(reader, tmp_path, tmp_path / "out", dtype="float32")
    text = _problems(exc)
    assert "has (4,) (layers, experts), the spec (3,)" in text
    assert "decoder.layers.0.mlp.linear_fc1.weight: the checkpoint's decoder.layers.mlp.linear_fc1.weight" in text
    assert "output_layer.weight (128, 64) is not a tensor of the qwen3 spec" in text
    assert reader.bytes_read == 0 and not (tmp_path / "out").exists()
    with pytest.raises(LayoutMismatchError, match="tensors are saved as torch.float32, the layout declares "
                                                  "torch.bfloat16"):
        export_hf(reader, ref, tmp_path / "out", dtype="bfloat16")


def test_cli_plans_from_a_checkpoint(dense, capsys):
    ckpt, ref = dense
    args = ["plan", "--model", str(ref), "--dtype", "float32", "--dst", "vllm:tp=2", "--json"]
    assert cli(args + ["--src", f"megatron-ckpt:{ckpt},readers=2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["src"].startswith("megatron:tp=1,pp=1,ep=1,etp=1,dp=2,world=2") and out["coverage"] == "exact"
    assert cli(args + ["--src", f"megatron-ckpt:{ckpt / 'nowhere'}"]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert cli(args + ["--src", f"megatron-ckpt:{ckpt},readers=0"]) == 2
    assert cli(args[:4] + ["bfloat16"] + args[5:] + ["--src", f"megatron-ckpt:{ckpt}"]) == 2
    assert "CLI --dtype" in capsys.readouterr().err
