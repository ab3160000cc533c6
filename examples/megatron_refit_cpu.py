"""Refit a live Megatron model into the HF layout on CPU: two trainer processes (TP=2) over gloo.

Each trainer rank builds a small Qwen3-shaped GPTModel with megatron-core, declares its layout, checks the live
model against it and binds its parameters without copying them (reshard.adapters.megatron), then runs its part
of the compiled plan Megatron -> HF over gloo send/recv. Rank 0 also hosts the HF destination and writes it as
a safetensors checkpoint; this process loads that into transformers' Qwen3ForCausalLM and compares its logits
with the Megatron model's on the same tokens.

    python examples/megatron_refit_cpu.py        # needs megatron-core, transformers, safetensors; ~1 min on CPU
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

import reshard
from reshard.testing.megatron_cpu import TinyGPT, build_model, forward_logits, init_parallel, run_ranks

TINY = TinyGPT()  # 4 layers, hidden 64, 4 heads / 2 KV groups x 32, FFN 96, vocab 120 padded to 128


def declared_layouts() -> tuple[reshard.MegatronLayout, reshard.HfLayout]:
    spec = TINY.spec()
    return reshard.MegatronLayout(model=spec, tp=2, vocab_divisor=64), reshard.HfLayout(model=spec)


def trainer_rank(outdir: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from reshard.adapters.megatron import derive_layout, read_model, source_tensors
    from reshard.executors import allocate
    from reshard.executors.binding import Binding
    from reshard.executors.distributed import execute_distributed

    rank = dist.get_rank()
    init_parallel(tp=2)
    model = build_model(TINY)  # the live trainer model of this rank
    src_layout, hf = declared_layouts()
    facts = read_model(model)  # the live model, read once
    derived = derive_layout(facts, src_layout.model, like=src_layout)
    tensors = source_tensors(facts, src_layout)  # verifies the model against the layout, then binds views
    params = dict(model[0].named_parameters())
    views = sum(tensors[n].data_ptr() == params[n].data_ptr() for n in tensors)

    tokens = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))
    logits = forward_logits(model, tokens)

    plan = reshard.compile(src_layout, hf)
    dst = allocate(hf, fill=float("nan"), ranks=[0]) if rank == 0 else {}
    # Trainer ranks 0 and 1 are source ranks 0 and 1; process 0 also hosts the HF destination (rank 0).
    stats = execute_distributed(plan, Binding((0, 1), (0,)), {rank: tensors}, dst, timeout=120.0)
    sent = sum(stats.bytes_sent.values())
    if rank == 0:
        Path(outdir, "hf").mkdir()
        save_file(dst[0], str(Path(outdir, "hf", "model.safetensors")), metadata={"format": "pt"})
        save_file({"logits": logits, "tokens": tokens}, str(Path(outdir, "megatron.safetensors")))
    Path(outdir, f"rank{rank}.json").write_text(json.dumps({
        "derived": str(derived), "equal": derived == src_layout, "tensors": len(tensors), "views": views,
        "sent_bytes": sent, "digest": plan.digest}))


def main() -> int:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    src_layout, hf = declared_layouts()
    plan = reshard.compile(src_layout, hf)
    with tempfile.TemporaryDirectory() as tmp:
        wall = run_ranks(2, trainer_rank, tmp, timeout=600, errdir=tmp)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
        meg = load_file(str(Path(tmp, "megatron.safetensors")))
        TINY.hf_config().save_pretrained(Path(tmp, "hf"))
        model = AutoModelForCausalLM.from_pretrained(Path(tmp, "hf"), dtype=torch.float32).eval()
        with torch.no_grad():
            hf_logits = model(meg["tokens"]).logits
    diff = (hf_logits - meg["logits"][..., :TINY.vocab_size]).abs().max().item()

    print(plan)
    for r, info in enumerate(ranks):
        print(f"trainer rank {r}: derived {info['derived']} (equals declared: {info['equal']}); "
              f"{info['views']}/{info['tensors']} source tensors are views of live parameters; "
              f"sent {info['sent_bytes']:,} B over gloo, copied "
              f"{plan.accounting.egress_bytes[r] - info['sent_bytes']:,} B locally (rank 0 hosts HF)")
    same_plan = all(info["digest"] == plan.digest for info in ranks)
    print(f"plan digest identical on both trainer ranks and here: {same_plan}")
    print(f"verify: transformers Qwen3ForCausalLM on the refitted weights vs the Megatron model, same tokens: "
          f"max |logit diff| = {diff:.2e} (fp32; tolerance 2e-5)")
    print(f"wall time of the two trainer processes: {wall:.1f} s")
    ok = same_plan and diff <= 2e-5 and all(i["equal"] and i["views"] == i["tensors"] for i in ranks)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
