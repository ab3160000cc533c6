"""Refit a live Megatron model into a Hugging Face checkpoint: two trainer processes (tensor parallel 2) over
gloo, on CPU.

What each trainer process does with reshard: declare its layout and the destination's, check the live model
against the declaration and bind its parameters without copying them, compile the plan (every process compiles
the same one), and run its part of it. Process 0 hosts the destination here and saves it; this process then loads
the checkpoint into transformers and compares its logits with the Megatron model's on the same tokens, and exits 1
when they differ.

    python examples/megatron/refit.py      # the core virtualenv; about a minute on CPU

On GPUs: build your own GPTModel (no cpu_stand_ins), use NCCL, and send to an engine instead of a checkpoint
(examples/art, examples/nemo_rl, examples/verl).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import Qwen3Config

import reshard
from reshard.ports import free_port

TP = 2
HF = Qwen3Config(vocab_size=120, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, intermediate_size=96, rms_norm_eps=1e-6, max_position_embeddings=256, dtype="float32",
                 tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def layouts() -> tuple[reshard.MegatronLayout, reshard.HfLayout]:
    """The trainer's layout (the vocabulary padded to a multiple of 64 per TP rank, as Megatron does) and HF's."""
    spec = reshard.ModelSpec.from_hf_config(HF.to_dict())
    return reshard.MegatronLayout(model=spec, tp=TP, vocab_divisor=64), reshard.HfLayout(model=spec)


def start_trainer(rank: int, port: int) -> Any:
    """This trainer process's share of the model: gloo group, Megatron's parallel state (TP) and the GPTModel,
    its norms drawn away from one (ones would hide a swapped pair; the same values on every rank)."""
    from megatron.core import parallel_state

    from cpu_stand_ins import qwen3_gpt_model, run_megatron_on_cpu

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=TP, timeout=datetime.timedelta(seconds=120))
    run_megatron_on_cpu()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    model = qwen3_gpt_model(HF, layouts()[0].padded_vocab, TP)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.uniform_(0.8, 1.2, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
    return model


def save_logits(model: Any, outdir: str) -> None:
    """Every trainer process: the model's logits on fixed tokens, gathered over TP; process 0 saves them with the
    tokens to `outdir/megatron.safetensors` (what `logits_diff` compares transformers with)."""
    from safetensors.torch import save_file

    tokens = torch.randint(0, HF.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))
    positions = torch.arange(16)[None].expand(2, 16)
    mask = torch.triu(torch.ones(16, 16, dtype=torch.bool), diagonal=1)[None, None]  # Megatron: True = masked
    with torch.no_grad():
        local = model(tokens, positions, mask)  # this rank's vocabulary columns
    parts = [torch.empty_like(local) for _ in range(TP)]
    dist.all_gather(parts, local.contiguous())
    if dist.get_rank() == 0:
        save_file({"tokens": tokens, "logits": torch.cat(parts, -1)}, str(Path(outdir, "megatron.safetensors")))


def save_hf(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """An HF checkpoint directory of `tensors` (safetensors and the config)."""
    from safetensors.torch import save_file

    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    HF.save_pretrained(folder)


def logits_diff(hf_dir: Path, outdir: str) -> float:
    """max |logit difference| of transformers on the checkpoint `hf_dir` against the Megatron model's logits."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    megatron = load_file(str(Path(outdir, "megatron.safetensors")))
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(megatron["tokens"]).logits
    return (logits - megatron["logits"][..., :HF.vocab_size]).abs().max().item()


def trainer(rank: int, port: int, outdir: str) -> None:
    from reshard.adapters.megatron import read_model, source_tensors
    from reshard.executors import Binding, allocate, execute_collective

    model = start_trainer(rank, port)
    src, hf = layouts()
    tensors = source_tensors(read_model([model]), src)  # checks the live model against `src`, binds views
    plan = reshard.compile(src, hf)
    dst = allocate(hf, fill=float("nan"), ranks=[0]) if rank == 0 else {}  # NaN: bytes no plan wrote show
    stats = execute_collective(plan, Binding(src=(0, 1), dst=(0,)), {rank: tensors}, dst, timeout=120.0)
    save_logits(model, outdir)
    if rank == 0:
        save_hf(dst[0], Path(outdir, "hf"))
    sent = sum(stats.bytes_sent.values())
    Path(outdir, f"rank{rank}.json").write_text(json.dumps({"sent": sent, "digest": plan.digest,
                                                            "tensors": len(tensors)}))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", help="where the checkpoint goes (default: a temporary folder)")
    args = parser.parse_args()
    src, hf = layouts()
    plan = reshard.compile(src, hf)
    print(plan)
    with tempfile.TemporaryDirectory() as tmp:
        outdir = args.workdir or tmp
        mp.start_processes(trainer, args=(free_port(), outdir), nprocs=TP, start_method="spawn")
        ranks = [json.loads(Path(outdir, f"rank{r}.json").read_text()) for r in range(TP)]
        diff = logits_diff(Path(outdir, "hf"), outdir)
    for r, info in enumerate(ranks):
        print(f"trainer process {r}: {info['tensors']} source tensors bound to live parameters, "
              f"sent {info['sent']:,} B over gloo")
    same_plan = all(info["digest"] == plan.digest for info in ranks)
    print(f"plan digest the same in both trainer processes and here: {same_plan}")
    print(f"transformers on the refit checkpoint vs the Megatron model, same tokens: max |logit diff| = {diff:.2e} "
          "(fp32; tolerance 2e-5)")
    return 0 if same_plan and diff <= 2e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
