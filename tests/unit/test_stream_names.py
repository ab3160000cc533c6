"""StreamNames: the names real exporters stream, mapped onto the model's HF tensors.

Ground truth for the fused experts is transformers itself: a tiny random model of each family with fused experts,
its `state_dict()` (what verl's FSDP engine streams) split by reshard, against the checkpoint its `save_pretrained`
writes (transformers 5 reverts its conversion mapping there: per-expert names). The extras are the names NeMo-RL,
Megatron-Bridge and mbridge write (sources in `ModelFamily.stream_extras` and the families' own)."""
from __future__ import annotations

import logging

import pytest
import torch

from reshard.errors import ArgumentError, ModelConfigError
from reshard.integrations.streams import StreamNames
from reshard.layouts import ModelSpec
from reshard.layouts.families import discover, read_hf_config
from reshard.layouts.model import Entry, Experts, FusedExperts, Role

QWEN3_MOE, DEEPSEEK, QWEN35 = ("examples/configs/qwen3-30b-a3b.json", "examples/configs/deepseek-v3.json",
                               "examples/configs/qwen3.5-35b-a3b.json")


def _tiny(path: str) -> dict:
    config = read_hf_config(path)
    return discover(config).tiny_config(config)


def _text_only(path: str) -> dict:
    """The language model of a multimodal config as its own text-only checkpoint (Qwen3_5MoeForCausalLM)."""
    text = dict(_tiny(path)["text_config"])
    text.update(model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"])
    return text


def _split_all(names: StreamNames, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        for hf, t in names.split(name, tensor):
            assert hf not in out, f"{hf} came twice"
            out[hf] = t
    return out


@pytest.mark.parametrize("config,multimodal", [(_tiny(QWEN3_MOE), False), (_tiny(DEEPSEEK), False),
                                               (_tiny(QWEN35), True), (_text_only(QWEN35), False)],
                         ids=["qwen3_moe", "deepseek_v3", "qwen3_5_moe", "qwen3_5_moe_text"])
def test_a_transformers_state_dict_splits_into_what_save_pretrained_writes(tmp_path, config, multimodal):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(0)
    auto = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
    model = auto.from_config(AutoConfig.for_model(**config))
    with torch.no_grad():
        for p in model.parameters():  # distinct values everywhere (norms start at one: a swap would not show)
            p.normal_()
    state = model.state_dict()
    fused = sorted(n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj")))
    assert fused and all(state[n].dim() == 3 for n in fused), "transformers no longer fuses these experts"
    model.save_pretrained(tmp_path, safe_serialization=True)
    saved = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        saved.update(load_file(f))
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in saved), \
        "save_pretrained wrote fused experts: it no longer reverts its conversion"
    if multimodal:
        saved = {n: t for n, t in saved.items() if not n.startswith("model.visual.")}  # skipped: refits leave it out

    spec = ModelSpec.from_hf_config(config)
    out = _split_all(StreamNames(spec), state)
    assert set(out) == set(saved) == {t.name for t in spec.tensors}
    wrong = [n for n in saved if not torch.equal(out[n], saved[n])]
    assert not wrong, f"{len(wrong)} tensors differ from transformers' own checkpoint, e.g. {wrong[:3]}"
    for n in fused:  # the per-expert tensors are views of the streamed tensor (no copy)
        views = StreamNames(spec).split(n, state[n])
        assert all(t.untyped_storage().data_ptr() == state[n].untyped_storage().data_ptr() for _, t in views)


def test_the_fused_tensors_of_each_family_with_routed_experts():
    spec = ModelSpec.from_hf_config(QWEN3_MOE)  # 48 layers, 128 experts x 768, hidden 2048
    names = StreamNames(spec)
    gate_up = names.split("model.layers.47.mlp.experts.gate_up_proj", torch.empty(128, 1536, 2048, device="meta"))
    down = names.split("model.layers.47.mlp.experts.down_proj", torch.empty(128, 2048, 768, device="meta"))
    assert [n for n, _ in gate_up[:3]] == ["model.layers.47.mlp.experts.0.gate_proj.weight",
                                           "model.layers.47.mlp.experts.0.up_proj.weight",
                                           "model.layers.47.mlp.experts.1.gate_proj.weight"]
    assert len(gate_up) == 256 and len(down) == 128
    assert down[-1][0] == "model.layers.47.mlp.experts.127.down_proj.weight"
    v3 = StreamNames(ModelSpec.from_hf_config(DEEPSEEK))  # layers 0-2 dense
    with pytest.raises(ArgumentError, match="model.layers.2.mlp.experts.gate_up_proj"):
        v3.split("model.layers.2.mlp.experts.gate_up_proj", torch.empty(256, 4096, 7168, device="meta"))
    assert len(v3.split("model.layers.3.mlp.experts.gate_up_proj", torch.empty(256, 4096, 7168, device="meta"))) == 512
    qwen35 = StreamNames(ModelSpec.from_hf_config(QWEN35))  # the multimodal wrapper's prefix
    assert qwen35.split("model.language_model.layers.0.mlp.experts.down_proj",
                        torch.empty(256, 2048, 512, device="meta"))[0][0] == \
        "model.language_model.layers.0.mlp.experts.0.down_proj.weight"
    dense = StreamNames(ModelSpec.from_hf_config("examples/configs/qwen3-8b.json"))
    with pytest.raises(ArgumentError, match="is not a tensor of the qwen3 model"):
        dense.split("model.layers.0.mlp.experts.gate_up_proj", torch.empty(1, 2, 2))


def test_a_fused_tensor_of_another_shape_is_refused_naming_it():
    names = StreamNames(ModelSpec.from_hf_config(_tiny(QWEN3_MOE)))  # 4 experts x 32, hidden 64
    names.split("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(4, 64, 64))
    for bad in (torch.zeros(4, 64, 63), torch.zeros(3, 64, 64), torch.zeros(4, 64, 64).transpose(1, 2)[:, :, :32],
                torch.zeros(4 * 64 * 64), "a tensor"):
        with pytest.raises(ArgumentError, match=r"weights\[model.layers.0.mlp.experts.gate_up_proj\].*\[4, 64, 64\]"):
            names.split("model.layers.0.mlp.experts.gate_up_proj", bad)
    with pytest.raises(ArgumentError, match=r"experts.down_proj\]=\(4, 32, 64\).*\[4, 64, 32\]"):  # transposed
        names.split("model.layers.0.mlp.experts.down_proj", torch.zeros(4, 32, 64))


def test_one_tensor_streamed_in_both_forms_yields_its_name_twice():
    """What lets the callers' exactly-once check catch it: split names the same HF tensor either way."""
    names = StreamNames(ModelSpec.from_hf_config(_tiny(QWEN3_MOE)))
    fused = [n for n, _ in names.split("model.layers.1.mlp.experts.gate_up_proj", torch.zeros(4, 64, 64))]
    single = [n for n, _ in names.split("model.layers.1.mlp.experts.3.up_proj.weight", torch.zeros(32, 64))]
    assert single == ["model.layers.1.mlp.experts.3.up_proj.weight"] and single[0] in fused


def test_extras_are_skipped_with_one_log_line_per_kind(caplog):
    config = _tiny(DEEPSEEK)  # 3 layers
    names = StreamNames(ModelSpec.from_hf_config(config))
    one = torch.ones(1)
    extras = {  # NeMo-RL 7ea279a: fp8_train_utils.get_vllm_qkv_scale_names, then "draft." + the Eagle export
        "scales": [f"model.layers.{i}.self_attn.{s}" for i in range(3) for s in ("attn.q_scale", "k_scale", "v_scale")],
        "draft": ["draft.fc.weight", "draft.layers.0.self_attn.q_proj.weight", "draft.norm.weight", "draft.d2t"],
        # Megatron-Bridge deepseek/common.py and mbridge deepseek_v3.py: the MTP layer after the last one
        "mtp": ["model.layers.3.eh_proj.weight", "model.layers.3.enorm.weight",
                "model.layers.3.shared_head.norm.weight", "model.layers.3.mlp.experts.0.gate_proj.weight"],
        "inv_freq": ["model.layers.0.self_attn.rotary_emb.inv_freq"],  # Megatron-Bridge deepseek_v3_bridge.py
    }
    with caplog.at_level(logging.WARNING, logger="reshard.streams"):
        for group in extras.values():
            for n in group:
                assert names.split(n, one) == []
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == len(extras), lines
    assert any("KV-cache" in line and "model.layers.0.self_attn.attn.q_scale" in line for line in lines)
    for bad in ("model.layers.0.mlp.not_a_tensor.weight", "mtp.fc.weight", "lm_head.weight.extra", "draft",
                "model.layers.0.self_attn.k_scale.weight"):  # a typo, another family's MTP, near misses
        with pytest.raises(ArgumentError, match=f"weights='{bad}' is not a tensor of the deepseek_v3 model"):
            names.split(bad, one)
    with pytest.raises(ArgumentError, match="is not a tensor name"):
        names.split(3, one)
    qwen = StreamNames(ModelSpec.from_hf_config(_tiny(QWEN3_MOE)))  # 4 layers, no MTP: a scale past them is refused
    assert qwen.split("model.layers.3.self_attn.v_scale", one) == []
    with pytest.raises(ArgumentError, match="model.layers.4.self_attn.v_scale"):
        qwen.split("model.layers.4.self_attn.v_scale", one)


def test_qwen3_5_extras_mtp_and_the_vision_tower():
    mm = StreamNames(ModelSpec.from_hf_config(_tiny(QWEN35)))
    text = StreamNames(ModelSpec.from_hf_config(_text_only(QWEN35)))
    for n in ("mtp.fc.weight", "mtp.layers.0.mlp.experts.gate_up_proj", "model.visual.blocks.0.attn.qkv.weight"):
        assert mm.split(n, torch.ones(1)) == []
    assert text.split("mtp.fc.weight", torch.ones(1)) == []
    with pytest.raises(ArgumentError, match="model.visual.blocks.0.attn.qkv.weight"):  # no vision tower here
        text.split("model.visual.blocks.0.attn.qkv.weight", torch.ones(1))


def test_tied_embeddings_skip_the_output_layer_copy_only_when_tied():
    config = _tiny("examples/configs/qwen3-0.6b.json")
    assert config["tie_word_embeddings"]
    assert StreamNames(ModelSpec.from_hf_config(config)).split("lm_head.weight", torch.ones(1)) == []
    untied = StreamNames(ModelSpec.from_hf_config({**config, "tie_word_embeddings": False}))
    assert [n for n, _ in untied.split("lm_head.weight", torch.ones(1))] == ["lm_head.weight"]


def test_a_fused_declaration_must_stack_2d_entries_of_one_width():
    gate, down = Entry("g.{e}", (4, 8), Role.EXPERT_GATE), Entry("d.{e}", (8, 4), Role.EXPERT_DOWN)
    Experts((gate, down), 2, fused=(FusedExperts("gd", (0,)),))
    for parts in ((0, 1), (2,), ()):
        with pytest.raises(ModelConfigError, match="gd"):
            Experts((gate, down), 2, fused=(FusedExperts("gd", parts),))
