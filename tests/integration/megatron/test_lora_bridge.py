"""Megatron-Bridge's adapters, built from megatron-core's own parallel linears as its ParallelLinearAdapter builds
them, on a real GPTModel at TP 2 (gloo), each shard filled at megatron-core's own sharded-state offsets: the
parameter names, local shapes and offsets are what `MegatronLayout` declares for the adapter spec, and a refit
from views of the live parameters (`adapters.megatron.source_tensors`) over gloo into a PEFT layout equals the
PEFT tensors written out by hand from megatron-core's global tensors (Megatron-Bridge's export: a fused layer's A
under each part, linear_qkv's B de-interleaved by query group, linear_fc1's B split per rank into gate and up).
The same model saved by megatron-core's dist_checkpointing (torch_dist, keyed as Bridge's AdapterWrapper keys it)
is a source too: two reader processes, each reading only its part, write a PEFT directory equal to the same
hand-written export, which PEFT's own loader merges into W + (alpha / r) B A; a checkpoint whose adapter disagrees
with the declared rank or targets is refused before anything is written.
(Megatron-Bridge itself does not install here: Python 3.12, transformers <= 5.12.1.)"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import reshard
from reshard.layouts.lora import lora_spec
from harness.lora import bridge_refit_job, global_value
from reshard.testing.megatron_cpu import TinyGPT, run_ranks

pytestmark = [pytest.mark.megatron, pytest.mark.gloo]
TP, RANK = 2, 8


def _global(layer: int, target: str, which: str, rows: int, cols: int) -> torch.Tensor:
    return torch.tensor([[global_value(layer, target, which, i, j) for j in range(cols)] for i in range(rows)])


def _expected_peft(tiny: TinyGPT) -> dict[str, torch.Tensor]:
    H, d, g, F = tiny.hidden_size, tiny.head_dim, tiny.num_query_groups, tiny.ffn_hidden_size
    hpg, q = tiny.num_attention_heads // g, tiny.num_attention_heads * tiny.head_dim
    out = {}
    for i in range(tiny.num_layers):
        p = f"base_model.model.model.layers.{i}."
        a = _global(i, "linear_qkv", "in", RANK, H)
        b = _global(i, "linear_qkv", "out", (hpg + 2) * d * g, RANK)
        groups = b.view(g, (hpg + 2) * d, RANK)  # megatron-core's linear_qkv rows: [q heads; k; v] per group
        parts = {"q_proj": groups[:, :hpg * d].reshape(-1, RANK), "k_proj": groups[:, hpg * d:(hpg + 1) * d].reshape(-1, RANK),
                 "v_proj": groups[:, (hpg + 1) * d:].reshape(-1, RANK)}
        for m, rows in parts.items():
            out[f"{p}self_attn.{m}.lora_A.weight"], out[f"{p}self_attn.{m}.lora_B.weight"] = a, rows
        out[f"{p}self_attn.o_proj.lora_A.weight"] = _global(i, "linear_proj", "in", RANK, q)
        out[f"{p}self_attn.o_proj.lora_B.weight"] = _global(i, "linear_proj", "out", H, RANK)
        a = _global(i, "linear_fc1", "in", RANK, H)
        per_rank = _global(i, "linear_fc1", "out", 2 * F, RANK).view(TP, 2, F // TP, RANK)  # [gate_r; up_r]
        for s, m in enumerate(("gate_proj", "up_proj")):
            out[f"{p}mlp.{m}.lora_A.weight"], out[f"{p}mlp.{m}.lora_B.weight"] = a, per_rank[:, s].reshape(F, RANK)
        out[f"{p}mlp.down_proj.lora_A.weight"] = _global(i, "linear_fc2", "in", RANK, F)
        out[f"{p}mlp.down_proj.lora_B.weight"] = _global(i, "linear_fc2", "out", H, RANK)
    return out


@pytest.fixture(scope="module")
def bridge(tmp_path_factory):
    """The live TP-2 model with Bridge adapters: its refit into PEFT tensors, and its torch_dist checkpoint."""
    out = tmp_path_factory.mktemp("bridge")
    (out / "ckpt").mkdir()
    run_ranks(TP, bridge_refit_job, TP, str(out), RANK, str(out / "ckpt"), errdir=str(out), timeout=240)
    return out


def test_bridge_adapters_refit_from_a_live_megatron_model(bridge):
    tmp_path = bridge
    tiny = TinyGPT(num_layers=2)
    spec = lora_spec(tiny.spec(), RANK, 16)
    layout = reshard.MegatronLayout(model=spec, tp=TP)
    for r in range(TP):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        declared = layout.rank_tensors(r)
        assert sorted(got["parameters"]) == sorted(declared)            # names, as the live model has them
        for name, shard in got["shards"].items():
            assert tuple(shard["local"]) == declared[name], name       # local shapes
            cut = [k for k, (n, m) in enumerate(zip(shard["global"], shard["local"])) if n != m]
            assert len(cut) == 1 and shard["offset"][cut[0]] == r * shard["local"][cut[0]], name
    got, want = load_file(str(tmp_path / "peft.safetensors")), _expected_peft(tiny)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def test_peft_directory_straight_from_a_bridge_checkpoint(bridge, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from reshard.adapters.megatron.checkpoint import open_checkpoint
    from harness.lora import reference_merge
    from harness.megatron_ckpt import peft_reader_job

    tiny = TinyGPT(num_layers=2)
    spec = lora_spec(tiny.spec(), RANK, 16)
    run_ranks(2, peft_reader_job, str(bridge / "ckpt"), spec.model_dump_json(), str(tmp_path), errdir=str(tmp_path),
              timeout=240)
    got, want = load_file(str(tmp_path / "peft" / "adapter_model.safetensors")), _expected_peft(tiny)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    ckpt = open_checkpoint(bridge / "ckpt")  # base weights and adapters: the readers read adapter records only
    adapter = sum(c.length for key, t in ckpt.tensors.items() if ".adapter." in key for c in t.chunks)
    read = [json.loads((tmp_path / f"reader{r}.json").read_text())["bytes_read"] for r in range(2)]
    assert all(0 < b < 0.75 * adapter for b in read) and sum(read) < adapter, (read, adapter)

    # PEFT's own loader: merging the directory gives W + (alpha / r) B A of the hand-written adapter, every module
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny.hf_config(), dtype=torch.float32)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    merged = {n: p.detach() for n, p in
              PeftModel.from_pretrained(model, str(tmp_path / "peft")).merge_and_unload().named_parameters()}
    checked = 0
    for name in want:
        if name.endswith("lora_A.weight"):
            module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = want[name.replace("lora_A", "lora_B")]
            expect = reference_merge(base[f"{module}.weight"], want[name], b, 16, RANK)
            assert torch.equal(merged[f"{module}.weight"], expect), module
            checked += 1
    assert checked == 2 * 7


def test_checkpoint_adapter_that_disagrees_with_the_declared_one_is_refused(bridge, tmp_path):
    from reshard.adapters.megatron.checkpoint import open_checkpoint
    from reshard.adapters.megatron.checkpoint_layout import export_peft
    from reshard.errors import LayoutMismatchError

    ckpt = open_checkpoint(bridge / "ckpt")
    spec = lora_spec(TinyGPT(num_layers=2).spec(), RANK // 2, 16, ["linear_qkv", "linear_proj", "linear_fc1"])
    with pytest.raises(LayoutMismatchError) as exc:
        export_peft(ckpt, spec, tmp_path / "peft")
    text = "\n".join(exc.value.problems)
    assert (f"decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight: the checkpoint's "
            f"decoder.layers.self_attention.linear_qkv.adapter.linear_in.weight has shape (2, {RANK}, 64)") in text
    assert ("decoder.layers.mlp.linear_fc2.adapter.linear_in.weight (2, 8, 96) is an adapter tensor the declared "
            "targets ['linear_qkv', 'linear_proj', 'linear_fc1'] do not include") in text
    assert ckpt.bytes_read == 0 and not (tmp_path / "peft").exists()
    report = export_peft(ckpt, lora_spec(TinyGPT(num_layers=2).spec(), RANK, 16), tmp_path / "peft")  # as saved
    assert report.bytes_read == ckpt.bytes_read > 0
    assert sorted(load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))) == sorted(
        _expected_peft(TinyGPT(num_layers=2)))
