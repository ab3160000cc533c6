"""One process (gloo, world 1): an expert LoRA adapter of a tiny Qwen3-MoE (per expert, or one shared by all
experts), refit by reshard from Megatron-Bridge's TEGroupedMLP adapters (ep=2, expert TP 2) into a PEFT directory,
loaded by vLLM 0.33's own loader: the expected modules vLLM derives for the model (its supported modules and packed
mapping, as WorkerLoRAManager._load_adapter combines them), PEFTHelper, LoRAModel.from_local_checkpoint, then
PackedLoRALayerWeights.pack_moe over the experts in vLLM's packed order (what FusedMoEWithLoRA.set_lora receives).
Reports what differs from the canonical values the adapter was made of.

    python expert_lora_checks.py OUT_DIR MOE_CKPT
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from vllm_harness import build_model, init_parallel, write_json

RANK, ALPHA = 8, 12.0


def check(out: Path, ckpt: str, experts: str) -> dict:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import PackedLoRALayerWeights
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import get_supported_lora_modules, process_packed_modules_mapping

    import reshard
    from reshard.adapters.lora import PeftDirectory
    from reshard.executors import execute_local, shard
    from reshard.layouts.lora import PeftLayout, VllmLoraLayout, lora_spec

    config = EngineArgs(model=ckpt, dtype="float32", skip_tokenizer_init=True, enforce_eager=True,
                        max_model_len=128, load_format="dummy", enable_lora=True, max_lora_rank=RANK,
                        max_loras=1).create_engine_config()
    model = build_model(config)
    packed = process_packed_modules_mapping(model)
    expected: set[str] = set()
    for module in get_supported_lora_modules(model):  # WorkerLoRAManager._load_adapter's expected modules
        expected.update(packed.get(module, [module]))
        if module == "experts":
            expected.add(module)

    base = reshard.ModelSpec.from_hf_config(ckpt).model_copy(update={"dtype": "float32"})
    spec = lora_spec(base, RANK, ALPHA, expert_adapters=experts)  # every target: attention and the experts
    g = torch.Generator().manual_seed(11)
    canon = {t.name: torch.randn(t.shape, generator=g) for t in spec.tensors}
    src = reshard.MegatronLayout(model=spec, tp=2, ep=2, etp=2, naming="te")
    peft = PeftDirectory(out / f"adapter-{experts}", PeftLayout(model=spec))
    execute_local(reshard.compile(src, peft.layout), shard(src, canon), {0: peft.tensors})
    path = str(peft.publish("v1"))

    helper = PEFTHelper.from_local_dir(path, config.model_config.max_model_len)
    helper.validate_legal(config.lora_config)
    lora = LoRAModel.from_local_checkpoint(path, expected, helper, lora_model_id=1, device="cpu",
                                           dtype=torch.float32)
    problems, checked = [], 0

    def same(what: str, got: torch.Tensor, want: torch.Tensor, sides: str = "vLLM's / canonical") -> None:
        nonlocal checked
        checked += 1
        if tuple(got.shape) != tuple(want.shape) or not torch.equal(got, want):
            problems.append(f"{what}: {sides} differ (shapes {tuple(got.shape)} / {tuple(want.shape)})")

    parts = {m: ("gate_up_proj.lora_A", f"{m}.lora_B") for m in ("gate_proj", "up_proj")}
    parts["down_proj"] = ("down_proj.lora_A", "down_proj.lora_B")
    slots = shard(VllmLoraLayout(model=spec, tp=1, max_lora_rank=RANK), canon)[0]
    scalings = set()
    for i in range(spec.num_layers):
        p = f"model.layers.{i}.mlp."
        for e in range(spec.num_experts):
            for m, (a, b) in parts.items():
                w = lora.loras.get(f"{p}experts.{e}.{m}")
                if w is None:
                    problems.append(f"{p}experts.{e}.{m}: not loaded by vLLM")
                    continue
                own = f"{p}experts.{e}." if experts == "per_expert" else f"{p}experts."  # or the shared one
                same(f"{p}experts.{e}.{m} A", w.lora_a, canon[f"{own}{a}.weight"])
                same(f"{p}experts.{e}.{m} B", w.lora_b, canon[f"{own}{b}.weight"])
                scalings.add(w.scaling)
        names = [f"{p}{r}" for r in packed["experts"]]  # the manager's packed sub-module names, in its order
        stacked = PackedLoRALayerWeights.pack_moe([lora.loras.get(n) for n in names], f"{p}experts")
        # set_lora(lora_a=[w1, w2, w3], lora_b=[...]) copies each into [slot, :, :r, :] at TP 1: reshard's slots
        for k, (buf, s) in enumerate((("w13", 0), ("w2", 0), ("w13", 1))):
            for ab, packed_ab in (("a", stacked.lora_a[k]), ("b", stacked.lora_b[k])):
                same(f"{p}experts.{buf}_lora_{ab}_stacked.{s}", slots[f"{p}experts.{buf}_lora_{ab}_stacked.{s}"],
                     packed_ab, "reshard's slot / vLLM's packed")
    return {"checked": checked, "problems": problems[:8], "scalings": sorted(scalings),
            "experts_expected": sorted(m for m in expected if m.startswith("experts"))[:4],
            "loaded": len(lora.loras)}


def main() -> None:
    out, ckpt = Path(sys.argv[1]), sys.argv[2]
    init_parallel(ckpt, 1, 0)
    write_json(out / "report.json", {experts: check(out, ckpt, experts) for experts in ("per_expert", "shared")})


if __name__ == "__main__":
    main()
