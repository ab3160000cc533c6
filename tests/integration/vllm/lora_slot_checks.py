"""One vLLM TP rank, for test_lora_slots.py (world_checks.py runs `run_case` in each rank's process of the
session's world, gloo): vLLM 0.33's own LoRA manager loads the adapter `peft` saved (from_local_checkpoint,
activate_adapter -> set_lora) into slot A; a reshard plan from Megatron-Bridge shards lands the same adapter's
values in the slot of another loaded adapter (SlotRefit); every buffer of the two slots must hold the same bytes.
Per case: a checkpoint, vLLM's max_lora_rank and fully_sharded_loras.
"""
from __future__ import annotations

import torch

from vllm_harness import build_model


def _slot(manager, lora_id: int) -> dict[str, torch.Tensor]:
    slot = manager.lora_index_to_id.index(lora_id)
    out = {}
    for name, module in manager.modules.items():
        if ".layers." not in name:  # embeddings and lm_head: LoRA layers the adapter does not target
            continue
        for attr in ("lora_a_stacked", "lora_b_stacked"):
            buffers = getattr(module, attr, None)
            buffers = (buffers,) if isinstance(buffers, torch.Tensor) else buffers or ()
            for s, t in enumerate(buffers):
                if t.dim() == 4:
                    out[f"{name}.{attr}.{s}"] = t[slot].clone()
    return out


def run_case(case: dict, rank: int, world: int) -> dict:
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.lora.request import LoRARequest
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    import reshard
    from reshard.adapters.lora.slots import SlotRefit
    from reshard.executors import shard
    from reshard.layouts.lora import VllmLoraLayout, lora_spec

    config = EngineArgs(model=case["ckpt"], tensor_parallel_size=world, dtype="float32", skip_tokenizer_init=True,
                        enforce_eager=True, max_model_len=128, load_format="dummy", enable_lora=True,
                        max_lora_rank=case["max_lora_rank"], max_loras=2,
                        fully_sharded_loras=case["fully_sharded"],
                        lora_target_modules=case.get("engine_targets"),
                        distributed_executor_backend="external_launcher" if world > 1 else None
                        ).create_engine_config()
    model = build_model(config)
    with set_current_vllm_config(config):
        workers = LRUCacheWorkerLoRAManager(config, torch.device("cpu"), getattr(model, "embedding_modules", {}))
        workers.create_lora_manager(model, config)
        workers.add_adapter(LoRARequest("peft", 1, case["peft"]))
        workers.add_adapter(LoRARequest("other", 2, case["other"]))
    manager = workers._adapter_manager
    before = _slot(manager, 2)
    weights = load_file(case["weights"])
    base = reshard.ModelSpec.from_hf_config(case["ckpt"]).model_copy(update={"dtype": "float32"})
    spec = lora_spec(base, case["rank"], case["alpha"], case["targets"])
    src = reshard.MegatronLayout(model=spec, tp=case["trainer_tp"])
    dst = VllmLoraLayout(model=spec, tp=world, max_lora_rank=case["max_lora_rank"],
                         fully_sharded=case["fully_sharded"])
    SlotRefit(reshard.compile(src, dst), shard(src, weights), manager, 2, rank=rank).refit()
    want, got = _slot(manager, 1), _slot(manager, 2)
    differ = [n for n in want if not torch.equal(want[n], got[n])]
    return {"buffers": len(want), "differ": differ[:5], "changed": any(not torch.equal(before[n], got[n])
                                                                        for n in got),
            "kinds": sorted({type(manager.modules[n.rsplit(".lora_", 1)[0]]).__name__ for n in want})}

