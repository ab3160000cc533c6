"""A vLLM engine with LoRA enabled, in this process, for LoRA refit tests (run by the vLLM CPU build's python):

    python -m harness.lora_engine job.json

job: {"checkpoint", "peft" (the adapter saved by peft), "ours" (the PEFT directory reshard published), "initial"
(a directory of other values, loaded into the slot that the in-slot refit then rewrites), "shards" (a directory
of `<rank>.safetensors`: the Megatron-Bridge source tensors of the refit), "third_shards" and "third_peft" (a
third adapter's values: source tensors, and as `peft` saved them), "tiny" (TinyGPT fields), "rank",
"alpha", "tp" (the trainer's), "out"}. Writes `out` (JSON): greedy tokens of the base model, of each adapter, of
the slot before and after the in-slot refit and after each refused refit; whether the slots of the peft-saved,
the directory-loaded and the refit adapter hold the same bytes; each refused refit's error; the slot after a
TrainerSession refit of the third values through the worker extension (and the weight-transfer API's refusal).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

PROMPTS = [[1, 5, 9, 13, 2], [7, 3, 3, 8], [11, 4, 19, 23, 42, 5]]
IDS = {"peft": 1, "ours": 2, "slot": 3, "third": 4}


def _slot_bytes(manager: Any, lora_id: int) -> dict[str, Any]:
    """Every LoRA buffer of adapter `lora_id`'s slot, copied (read straight off vLLM's modules)."""
    import torch

    slot = manager.lora_index_to_id.index(lora_id)
    out = {}
    for name, module in manager.modules.items():
        for attr in ("lora_a_stacked", "lora_b_stacked"):
            buffers = getattr(module, attr, None)
            buffers = (buffers,) if isinstance(buffers, torch.Tensor) else buffers or ()
            for s, t in enumerate(buffers):
                if t.dim() == 4:  # the linear layers' [max_loras, 1, rows, cols]
                    out[f"{name}.{attr}.{s}"] = t[slot].clone()
    return out


def _same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main(job_path: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: the slot refit is in process
    job = json.loads(Path(job_path).read_text())
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    import reshard
    from reshard.adapters.lora.slots import SlotRefit, lora_manager
    from reshard.errors import ReshardError
    from reshard.layouts.lora import VllmLoraLayout, lora_spec
    from reshard.planner.cache import cached_plan
    from reshard.testing.megatron_cpu import TinyGPT

    rank, alpha, tp = job["rank"], job["alpha"], job["tp"]
    from reshard.adapters.vllm.engine import register

    register()  # the `reshard` weight-transfer engine, in this process (the engine runs here)
    llm = LLM(model=job["checkpoint"], dtype="float32", enforce_eager=True, max_model_len=128, enable_lora=True,
              max_lora_rank=rank, max_loras=3, max_cpu_loras=4, skip_tokenizer_init=True,
              weight_transfer_config={"backend": "reshard"},
              worker_extension_cls="reshard.adapters.vllm.worker.ReshardWorkerExtension")
    params = SamplingParams(temperature=0, max_tokens=8)

    def greedy(request: Any = None) -> list[list[int]]:
        llm.reset_prefix_cache()
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, lora_request=request,
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    requests = {"peft": LoRARequest("peft", IDS["peft"], job["peft"]),
                "ours": LoRARequest("ours", IDS["ours"], job["ours"]),
                "slot": LoRARequest("slot", IDS["slot"], job["initial"])}
    result: dict[str, Any] = {"base": greedy()}
    for key, request in requests.items():
        result[key] = greedy(request)
    manager = llm.collective_rpc(lora_manager)[0]
    result["slots_equal_peft_ours"] = _same(_slot_bytes(manager, 1), _slot_bytes(manager, 2))
    result["slot_equals_peft_before"] = _same(_slot_bytes(manager, 1), _slot_bytes(manager, 3))

    base = TinyGPT(**job["tiny"]).spec()
    spec = lora_spec(base, rank, alpha)
    src_layout = reshard.MegatronLayout(model=spec, tp=tp)
    src = {r: load_file(str(Path(job["shards"]) / f"{r}.safetensors")) for r in range(src_layout.num_ranks)}
    dst_layout = VllmLoraLayout(model=spec, tp=1, max_lora_rank=rank)
    start = time.perf_counter()
    refit = SlotRefit(cached_plan(src_layout, dst_layout), src, manager, IDS["slot"])
    result["bind_seconds"] = time.perf_counter() - start
    start = time.perf_counter()
    refit.refit()
    result["refit_seconds"] = time.perf_counter() - start
    result["slot_after"] = greedy(requests["slot"])
    result["slot_equals_peft_after"] = _same(_slot_bytes(manager, 1), _slot_bytes(manager, 3))

    # refused refits: each raises before a byte moves, and the served adapter stays as it is
    served = _slot_bytes(manager, IDS["slot"])
    cases = {
        "rank above max_lora_rank": lambda: VllmLoraLayout(model=lora_spec(base, 2 * rank, alpha), tp=1,
                                                           max_lora_rank=rank),
        "rank differs from the loaded adapter's": lambda: SlotRefit(cached_plan(
            reshard.MegatronLayout(model=lora_spec(base, rank // 2, alpha), tp=tp),
            VllmLoraLayout(model=lora_spec(base, rank // 2, alpha), tp=1, max_lora_rank=rank)), {}, manager, 3),
        "alpha mismatch": lambda: SlotRefit(cached_plan(
            reshard.MegatronLayout(model=lora_spec(base, rank, 2 * alpha), tp=tp),
            VllmLoraLayout(model=lora_spec(base, rank, 2 * alpha), tp=1, max_lora_rank=rank)), src, manager, 3),
        "unsupported target module": lambda: lora_spec(base, rank, alpha, ["linear_qkv", "router"]),
        "targets differ from the loaded adapter's": lambda: SlotRefit(cached_plan(
            reshard.MegatronLayout(model=lora_spec(base, rank, alpha, ["linear_qkv"]), tp=tp),
            VllmLoraLayout(model=lora_spec(base, rank, alpha, ["linear_qkv"]), tp=1, max_lora_rank=rank)),
            {}, manager, 3),
        "missing slot": lambda: SlotRefit(cached_plan(src_layout, dst_layout), src, manager, 99),
        "max_lora_rank differs from the engine's": lambda: SlotRefit(cached_plan(
            src_layout, VllmLoraLayout(model=spec, tp=1, max_lora_rank=2 * rank)), src, manager, 3),
    }
    result["refused"] = {}
    for label, make in cases.items():
        try:
            make()
            result["refused"][label] = None
        except ReshardError as e:
            result["refused"][label] = f"{type(e).__name__}: {e}"
    result["served_unchanged"] = _same(served, _slot_bytes(manager, IDS["slot"]))
    result["slot_after_refused"] = greedy(requests["slot"])

    # the same slot refit by a TrainerSession (inprocess transport) through the reshard worker extension, with a
    # third adapter's values; vLLM loading the adapter `peft` saved of those values is the ground truth
    from reshard.adapters.refit import RefitSpec
    from reshard.adapters.trainer import TrainerSession
    from reshard.adapters.server import ExtensionClient
    from reshard.adapters.vllm.trainer import OfflineLLMClient
    from reshard.errors import ExecutionError

    requests["third"] = LoRARequest("third", IDS["third"], job["third_peft"])
    result["third"] = greedy(requests["third"])
    third = {r: load_file(str(Path(job["third_shards"]) / f"{r}.safetensors")) for r in range(src_layout.num_ranks)}
    refit_spec = RefitSpec.of(spec, src_layout, dst_layout, install="lora_slot", lora_id=IDS["slot"],
                              transport="inprocess", options={"key": "lora"})
    before = _slot_bytes(manager, IDS["slot"])
    session = TrainerSession(refit_spec, 0, third, engines=[OfflineLLMClient(llm)], pause=None)
    try:  # vLLM's weight-transfer API drops every adapter when an update finishes: refused at init
        session.init()
        result["api_refused"] = None
    except ExecutionError as e:
        result["api_refused"] = str(e)
    finally:
        session.close()
    result["api_refused_unchanged"] = _same(before, _slot_bytes(manager, IDS["slot"]))
    session = TrainerSession(refit_spec, 0, third, engines=[ExtensionClient(llm)], pause=None)
    session.init()
    session.refit("third")
    session.close()
    result["extension_slot_after"] = greedy(requests["slot"])
    result["extension_slot_equals_third"] = _same(_slot_bytes(manager, IDS["third"]),
                                                  _slot_bytes(manager, IDS["slot"]))
    Path(job["out"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
