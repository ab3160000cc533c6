"""An expert LoRA adapter (per expert, or one shared by all experts) of a tiny Qwen3-MoE, refit by reshard from
Megatron-Bridge's TEGroupedMLP adapters into a PEFT directory, means to PEFT itself (peft 0.21 on transformers 5,
whose Qwen3-MoE holds fused 3D expert parameters and converts per-expert adapter names on load) the adapter it was
made of: PeftModel.from_pretrained + merge_and_unload gives every expert W_e + (alpha / r) B_e A_e (gate and up
halves of gate_up_proj, down_proj), computed here by hand. Every layer is sparse: for a MoE model, PEFT on
transformers 5 rewrites target_modules gate/up/down_proj into target_parameters of the experts, which drops the
adapters of a dense (mlp_only) layer's MLP; vLLM loads those (test_expert_lora_peft)."""
from __future__ import annotations

import pytest
import torch

import reshard
from reshard.adapters.lora import PeftDirectory
from reshard.executors import execute_local, shard
from reshard.layouts.lora import PeftLayout, lora_spec

RANK, ALPHA, E = 4, 12.0, 4


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=8, vocab_size=64, intermediate_size=48,
                                         moe_intermediate_size=16, num_experts=E, num_experts_per_tok=2,
                                         mlp_only_layers=[], dtype="float32")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = tmp_path_factory.mktemp("qwen3_moe") / "base"
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("experts", ["per_expert", "shared"])
def test_peft_merges_reshard_expert_adapter_as_its_canonical_values(base_dir, tmp_path, experts):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    base = reshard.ModelSpec.from_hf_config(str(base_dir)).model_copy(update={"dtype": "float32"})
    spec = lora_spec(base, RANK, ALPHA, ["linear_fc1", "linear_fc2"], expert_adapters=experts)
    g = torch.Generator().manual_seed(1)
    canon = {t.name: torch.randn(t.shape, generator=g) for t in spec.tensors}
    src = reshard.MegatronLayout(model=spec, tp=2, ep=2, etp=2, naming="te")
    directory = PeftDirectory(tmp_path / "adapter", PeftLayout(model=spec))
    execute_local(reshard.compile(src, directory.layout), shard(src, canon), {0: directory.tensors})
    path = directory.publish("v1")

    w = {n: p.detach().clone() for n, p in AutoModelForCausalLM.from_pretrained(base_dir).named_parameters()}
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(path))
    merged = {n: p.detach() for n, p in model.merge_and_unload().named_parameters()}
    s = ALPHA / RANK

    def close(name: str, want: torch.Tensor, got: torch.Tensor) -> None:  # PEFT sums in its own order
        assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-4), name

    for x, e in ((f"model.layers.{i}.mlp.experts.", e) for i in range(2) for e in range(E)):
        own = f"{x}{e}." if experts == "per_expert" else x
        a = canon[own + "gate_up_proj.lora_A.weight"]
        delta = torch.cat([canon[own + "gate_proj.lora_B.weight"] @ a, canon[own + "up_proj.lora_B.weight"] @ a])
        close(f"{x}{e} gate_up", w[x + "gate_up_proj"][e] + s * delta, merged[x + "gate_up_proj"][e])
        delta = canon[own + "down_proj.lora_B.weight"] @ canon[own + "down_proj.lora_A.weight"]
        close(f"{x}{e} down", w[x + "down_proj"][e] + s * delta, merged[x + "down_proj"][e])
