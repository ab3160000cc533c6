"""Refit a live Megatron model into an FP8 block-scaled destination (DeepSeek-V3 / Qwen3-*-FP8 style), quantizing on
the way: two trainer processes (tensor parallel 2, gloo, on CPU) send the model of examples/megatron/refit.py in
bfloat16; each linear weight lands as float8_e4m3fn plus a float32 `weight_scale_inv` per block, the rest in bf16.

The ground truth is computed here, independently: the same model refit without FP8 (examples/megatron/refit.py
checks that refit against Megatron's logits), each block quantized by the formula vLLM's DeepGEMM helper uses
(amax = max |x| in float32, at least 1e-4; scale = amax / 448; fp8 = e4m3fn(x * (1 / scale))). Exits 1 unless the
FP8 refit equals it byte for byte.

    python examples/megatron/fp8.py      # the core virtualenv; under a minute on CPU
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import reshard
from reshard.ports import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
from refit import HF, TP, start_trainer  # noqa: E402 - this folder's model

BLOCK = (32, 32)  # a tiny model's blocks; real FP8 checkpoints use 128 x 128


def quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: `weight` quantized block by block (fp8 values, float32 scale per block)."""
    rows, cols = weight.shape
    br, bc = BLOCK
    blocks = weight.float().reshape(rows // br, br, cols // bc, bc)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-4) / 448.0
    q = (blocks * (1.0 / scale)[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.reshape(rows, cols), scale


def trainer(rank: int, port: int, outdir: str) -> None:
    """One trainer process: the plain refit (the reference's input), then the quantizing one."""
    from reshard.adapters.megatron import read_model, source_tensors
    from reshard.executors import Binding, allocate, execute_collective
    from reshard.executors.fp8 import Fp8Executor
    from reshard.layouts.fp8 import Fp8Scheme
    from reshard.planner.fp8 import compile_fp8

    model = start_trainer(rank, port).to(torch.bfloat16)
    spec = reshard.ModelSpec.from_hf_config({**HF.to_dict(), "dtype": "bfloat16"})
    src, hf = reshard.MegatronLayout(model=spec, tp=TP, vocab_divisor=64), reshard.HfLayout(model=spec)
    tensors = source_tensors(read_model([model]), src)
    binding = Binding(src=(0, 1), dst=(0,))
    plain = allocate(hf, ranks=[0]) if rank == 0 else {}
    execute_collective(reshard.compile(src, hf), binding, {rank: tensors}, plain, timeout=120.0)
    # --8<-- [start:fp8_refit]
    fp = compile_fp8(src, hf, Fp8Scheme(block=BLOCK))  # fp.where: per tensor kind, who quantizes
    dst = allocate(fp.full_dst, ranks=[0]) if rank == 0 else {}  # fp8 weights, float32 scales, the rest as is
    ex = Fp8Executor(fp, binding, rank, {rank: tensors}, dst, inner="collective", group=dist.group.WORLD)
    ex.refit()  # every weight update: the same executor again
    # --8<-- [end:fp8_refit]
    ex.close()
    if rank == 0:
        torch.save({"plain": plain[0], "fp8": dst[0]}, Path(outdir, "fp8.pt"))
        Path(outdir, "fp8.json").write_text(json.dumps({"where": fp.where, "wire": fp.wire_bytes,
                                                         "baseline": fp.baseline_bytes}))
    dist.barrier()  # every process done with the group before any tears it down (gloo aborts a torn pair)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", help="where the results go (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        outdir = args.workdir or tmp
        Path(outdir).mkdir(parents=True, exist_ok=True)
        mp.start_processes(trainer, args=(free_port(), outdir), nprocs=TP, start_method="spawn")
        saved = torch.load(Path(outdir, "fp8.pt"), weights_only=True)
        info = json.loads(Path(outdir, "fp8.json").read_text())
    plain, fp8 = saved["plain"], saved["fp8"]
    wrong, count = [], 0
    for name, want in plain.items():
        if f"{name}_scale_inv" in fp8:  # a quantized weight
            q, scale = quantized(want)
            count += 1
            same = torch.equal(fp8[name].view(torch.uint8), q.view(torch.uint8)) and torch.equal(
                fp8[f"{name}_scale_inv"], scale)
        else:
            same = torch.equal(fp8[name], want)
        if not same:
            wrong.append(name)
    print(f"where each kind is quantized: {info['where']}")
    print(f"wire {info['wire']:,} B with sender-side quantization, {info['baseline']:,} B without")
    print(f"{count} weights quantized, {len(plain) - count} tensors as they were; different from the reference: "
          f"{wrong or 'none'}")
    return 0 if count and not wrong and len(fp8) == len(plain) + count else 1


if __name__ == "__main__":
    sys.exit(main())
