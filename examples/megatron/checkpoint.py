"""Refit from a saved Megatron checkpoint, with no live model: reader processes read a megatron-core torch_dist
checkpoint by byte range and send each part where the destination's layout places it; here an HF checkpoint.

1. two trainer processes (tensor parallel 2, gloo, on CPU) save the model of examples/megatron/refit.py with
   megatron-core's own `dist_checkpointing.save` and record its logits on fixed tokens;
2. two reader processes (no Megatron model, no parallel state) each call `read_checkpoint`: the plan spreads the
   reading over them, reader 0 hosts the HF destination and saves it;
3. this process writes the same HF checkpoint with `export_hf` (one process reading everything), loads the
   readers' checkpoint into transformers and compares its logits with the Megatron model's; exits 1 when they
   differ or the two HF checkpoints are not byte-identical.

    python examples/megatron/checkpoint.py      # the core virtualenv; about a minute on CPU
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import reshard
from reshard.ports import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
from refit import HF, TP, logits_diff, save_hf, save_logits, start_trainer  # noqa: E402 - this folder's model

READERS = 2


def trainer(rank: int, port: int, outdir: str) -> None:
    """One trainer process: its TP shard of the model, saved into `outdir/ckpt` by megatron-core."""
    from megatron.core import dist_checkpointing

    from cpu_stand_ins import save_on_cpu

    model = start_trainer(rank, port)
    save_on_cpu()
    dist_checkpointing.save({"model": model.sharded_state_dict()}, str(Path(outdir, "ckpt")))
    save_logits(model, outdir)
    dist.barrier()  # every process done with the group before any tears it down (gloo aborts a torn pair)
    dist.destroy_process_group()


def reader(rank: int, port: int, outdir: str) -> None:
    """One reader process: its part of the checkpoint, sent to reader 0, which saves the HF checkpoint."""
    from reshard.adapters.megatron import read_checkpoint
    from reshard.executors import allocate

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=READERS, timeout=datetime.timedelta(seconds=120))
    checkpoint = str(Path(outdir, "ckpt"))
    # --8<-- [start:read_checkpoint]
    spec = reshard.ModelSpec.from_hf_config(HF.to_dict())  # the model the checkpoint holds
    dst = reshard.HfLayout(model=spec)
    out = {0: allocate(dst)[0]} if rank == 0 else {}  # destination rank 0 lives in reader process 0
    done = read_checkpoint(checkpoint, spec, dst, out)  # every reader process: its part, by byte range
    # --8<-- [end:read_checkpoint]
    Path(outdir, f"reader{rank}.json").write_text(json.dumps({"bytes_read": done.bytes_read,
                                                              "checkpoint_bytes": done.checkpoint_bytes}))
    if rank == 0:
        save_hf(out[0], Path(outdir, "hf"))
    dist.barrier()  # every process done with the group before any tears it down (gloo aborts a torn pair)
    dist.destroy_process_group()


def main() -> int:
    from reshard.adapters.megatron import export_hf

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", help="where the checkpoints go (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        outdir = args.workdir or tmp
        Path(outdir, "ckpt").mkdir(parents=True)  # dist_checkpointing.save writes into an existing, empty folder
        mp.start_processes(trainer, args=(free_port(), outdir), nprocs=TP, start_method="spawn")
        mp.start_processes(reader, args=(free_port(), outdir), nprocs=READERS, start_method="spawn")
        reads = [json.loads(Path(outdir, f"reader{r}.json").read_text()) for r in range(READERS)]
        HF.save_pretrained(Path(outdir, "config"))
        export_hf(Path(outdir, "ckpt"), Path(outdir, "config"), Path(outdir, "exported"))
        same = (Path(outdir, "hf", "model.safetensors").read_bytes()
                == Path(outdir, "exported", "model.safetensors").read_bytes())
        diff = logits_diff(Path(outdir, "hf"), outdir)
    for r, read in enumerate(reads):
        print(f"reader {r}: read {read['bytes_read']:,} of the checkpoint's {read['checkpoint_bytes']:,} B")
    print(f"export_hf (one process) wrote the same HF checkpoint as the {READERS} readers: {same}")
    print(f"transformers on the readers' checkpoint vs the Megatron model that saved it, same tokens: "
          f"max |logit diff| = {diff:.2e} (fp32; tolerance 2e-5)")
    return 0 if same and diff <= 2e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
