"""The mismatch stage's engine side, in the vLLM CPU virtualenv: an in-process `vllm.LLM` started on random weights
T scores a few sequences; reshard refits it (HF -> vLLM, loader install, in-process) with other weights, then with T
again; reshard.verify's float32 check must flag the first and pass the second against the fresh scores.
transformers' scores of T are reported beside them. Prints one `RESHARD_JSON {...}` line.

The engine runs without vLLM's plain rotary custom op (`ENGINE_CUSTOM_OPS`): the CPU build's kernel (0.32) rotates
only the first `tokens` rows of MLA's 3-D query (docs/guides/verify.md).

  python -m reshard.validate.mismatch_side CONFIG [--perturb NAME]     (NAME: a tensor corrupted on reshard's side)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

SEEDS = (21, 22)  # the engine's starting weights, the refit's
CPU_HEAD_DIM = 32  # vLLM's CPU attention kernels take head sizes of 32 and up; the tiny instances use 16
MLA_HEAD_DIM = 320  # the smallest latent + rope head size vLLM's MLA backends take
# Eager mode's custom ops ("all"), less the CPU rotary kernel that mis-rotates MLA's 3-D query (module docstring).
ENGINE_CUSTOM_OPS = ["all", "-rotary_embedding"]


def engine_config(tiny: dict[str, Any]) -> dict[str, Any]:
    """The tiny config with attention heads widened to sizes vLLM's CPU attention runs (layouts unchanged), and
    embeddings untied (the vLLM CPU build's tied lm_head refuses a loader install that names it)."""
    out = dict(tiny, tie_word_embeddings=False)
    if "kv_lora_rank" in out:  # MLA (DeepSeek-V3): vLLM's MLA takes kv_lora_rank + rope head sizes of 320 and up
        out.update(qk_nope_head_dim=CPU_HEAD_DIM, qk_rope_head_dim=CPU_HEAD_DIM, v_head_dim=CPU_HEAD_DIM,
                   kv_lora_rank=MLA_HEAD_DIM - CPU_HEAD_DIM)
    elif out.get("head_dim", CPU_HEAD_DIM) < CPU_HEAD_DIM:
        out["head_dim"] = CPU_HEAD_DIM
    return out


def random_checkpoint(config: dict[str, Any], out: Path, seed: int) -> dict[str, Any]:
    """Write an HF checkpoint of `config` at `out`, every tensor N(0, 1) (a misplaced element moves the
    log-probabilities), and return its tensors."""
    import torch
    from safetensors.torch import save_file

    from ..layouts import ModelSpec

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
    spec = ModelSpec.from_hf_config(str(out))
    gen = torch.Generator().manual_seed(seed)
    weights = {t.name: torch.randn(t.shape, generator=gen, dtype=torch.float32) for t in spec.tensors}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return weights


def mismatch_run(config_path: str, perturb: str | None = None, count: int = 3, length: int = 16) -> dict[str, Any]:
    """The stage's run (module docstring): the reports `before` (other weights), `after` (trained weights again)
    and `transformers`, as dicts."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: the inprocess transport
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm import LLM
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from ..adapters.refit import RefitSpec
    from ..adapters.vllm.trainer import OfflineLLMClient, ReshardTrainerInitInfo
    from ..executors import shard
    from ..layouts import HfLayout, ModelSpec, VllmLayout
    from ..verify import LLMScorer, checkpoint_scores, compare, engine_scores, random_sequences
    from .hf_parity import perturbed

    config = engine_config(json.loads(Path(config_path).read_text()))
    with tempfile.TemporaryDirectory(prefix="reshard_mismatch_") as tmp:
        other_dir, trained_dir = Path(tmp, "other"), Path(tmp, "trained")
        other = random_checkpoint(config, other_dir, SEEDS[0])
        trained = random_checkpoint(config, trained_dir, SEEDS[1])
        spec = ModelSpec.from_hf_config(str(trained_dir))
        sequences = random_sequences(spec.vocab_size, count, length)
        hf = checkpoint_scores(trained_dir, sequences)  # transformers: independent of vLLM and of reshard
        # MLA: the reference CPU backend (vLLM 0.32's AMX one, picked on AMX CPUs, refuses float32 weights)
        mla = {"attention_backend": "CPU_MLA"} if "kv_lora_rank" in config else {}
        llm = LLM(model=str(trained_dir), dtype="float32", enforce_eager=True, max_model_len=128,
                  skip_tokenizer_init=True, enable_prefix_caching=False, seed=0, **mla,
                  compilation_config={"custom_ops": ENGINE_CUSTOM_OPS},
                  weight_transfer_config={"backend": "reshard"},
                  worker_extension_cls="reshard.adapters.vllm.worker.ReshardWorkerExtension")
        scorer = LLMScorer(llm)
        fresh = engine_scores(scorer, sequences)  # vLLM's own loader on the trained weights
        source = HfLayout(model=spec)
        refit = RefitSpec.of(spec, source, VllmLayout(model=spec, tp=1), install="loader", transport="inprocess",
                             options={"key": "validate-mismatch"})
        tensors = shard(source, other)
        trainer = WeightTransferTrainerFactory.trainer_init(ReshardTrainerInitInfo(refit=refit.to_dict(), rank=0),
                                                            client=OfflineLLMClient(llm), source=tensors)
        try:
            trainer.send_weights(version="other")
            before = compare(fresh, engine_scores(scorer, sequences), "float32")
            want = shard(source, perturbed(trained, perturb) if perturb else trained)
            for rank, named in tensors.items():  # the trainer's tensors change in place, as after a step
                for name, tensor in named.items():
                    tensor.copy_(want[rank][name])
            trainer.send_weights(version="trained")
        finally:
            trainer.shutdown()
        engine = engine_scores(scorer, sequences)
    return {"before": before.to_dict(), "after": compare(fresh, engine, "float32").to_dict(),
            "transformers": compare(hf, engine, "float32").to_dict(), "sequences": count, "length": length}


def main() -> int:
    """`python -m reshard.validate.mismatch_side CONFIG [--perturb NAME]`: one `RESHARD_JSON` line of `mismatch_run`."""
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--perturb")
    args = ap.parse_args()
    sys.stdout.write("RESHARD_JSON " + json.dumps(mismatch_run(args.config, args.perturb)) + "\n")
    sys.stdout.flush()
    os._exit(0)  # the in-process engine's threads must not hold the exit


if __name__ == "__main__":
    sys.exit(main())
