"""Check a refit by the math, not the bytes: after a refit, the trainer's Megatron model and the engine score the
same token sequences (`reshard.verify`); the slice-sensitivity audit then perturbs one trainer tensor at a time,
refits, and checks that the engine responds as the trainer does.

Two trainer processes (tensor parallel 2, gloo, on CPU) refit the model of examples/megatron/refit.py into an
engine hosted by process 0. The engine here is transformers' Qwen3 whose parameters are the refit's destination
tensors (a refit rewrites them in place); with a `vllm serve` it is `reshard.adapters.VllmServer(url)` and the
refit a `TrainerSession`'s (examples/art/refit.py), with an in-process `vllm.LLM` `reshard.verify.LLMScorer(llm)`.
Exits 1 unless the refit passes the mismatch check and the audit, and a refit that swapped two tensors is caught.

    python examples/megatron/verify.py      # the core virtualenv; about a minute on CPU
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
from refit import HF, TP, layouts, start_trainer  # noqa: E402 - this folder's model


class TransformersEngine:
    """The engine side of the check (a `reshard.verify` Scorer): transformers' model whose parameters are the
    destination tensors of the refit.

    Args:
        tensors: the destination's tensors by HF name; the model uses them in place.
    """

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_config(HF, dtype=torch.float32, attn_implementation="eager").eval()
        self.model.load_state_dict(tensors, assign=True)  # the model's parameters are now the refit's tensors

    def prompt_logprobs(self, prompts: list[list[int]]) -> list[tuple[list[float], list[int]]]:
        """Per prompt, (log-probability, argmax token) at every position after the first."""
        from reshard.verify import hf_model_scores

        scores = hf_model_scores(self.model, prompts)
        return [(list(lp), list(am)) for lp, am in zip(scores.logprobs, scores.argmax)]


def trainer(rank: int, port: int, outdir: str) -> None:
    """One trainer process: refit the engine, check it, audit it, then show a wrong refit caught."""
    from reshard.adapters.megatron import read_model, source_tensors
    from reshard.errors import MismatchError
    from reshard.executors import Binding, allocate, execute_collective
    from reshard.verify import audit, check_after_refit, check_audit, measure, random_sequences

    model = start_trainer(rank, port)
    src, hf = layouts()
    chunks = [model]
    tensors = source_tensors(read_model(chunks), src)
    plan = reshard.compile(src, hf)
    dst = allocate(hf, ranks=[0]) if rank == 0 else {}
    engine = TransformersEngine(dst[0]) if rank == 0 else None  # the engine side is asked on trainer rank 0 only

    def refit() -> None:
        execute_collective(plan, Binding(src=(0, 1), dst=(0,)), {rank: tensors}, dst, timeout=120.0)

    refit()
    sequences = random_sequences(HF.vocab_size, 4, 16)  # the same on every trainer rank
    # --8<-- [start:verify_after_refit]
    report = measure(chunks, engine, sequences, vocab_size=HF.vocab_size, dtype="float32")
    check_after_refit(chunks, engine, sequences, vocab_size=HF.vocab_size, dtype="float32")  # raises beyond
    audited = check_audit(audit(chunks, tensors, refit, engine, sequences, vocab_size=HF.vocab_size,
                                dtype="float32"))  # one tensor of each kind: a refit each
    # --8<-- [end:verify_after_refit]
    # a wrong refit (what a wrong layout does): the engine's gate and up projections of layer 0 exchanged
    if rank == 0:
        gate, up = (dst[0][f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up"))
        with torch.no_grad():
            swapped = gate.clone()
            gate.copy_(up)
            up.copy_(swapped)
    try:
        check_after_refit(chunks, engine, sequences, vocab_size=HF.vocab_size, dtype="float32", log=None)
        caught = None
    except MismatchError as e:
        caught = str(e).splitlines()[0]
    if rank == 0:
        Path(outdir, "verify.json").write_text(json.dumps({
            "ok": report.ok, "audit": str(audited), "audited": len(audited.entries),
            "caught": caught}))
    dist.barrier()  # every process done with the group before any tears it down (gloo aborts a torn pair)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", help="where the result goes (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        outdir = args.workdir or tmp
        Path(outdir).mkdir(parents=True, exist_ok=True)
        mp.start_processes(trainer, args=(free_port(), outdir), nprocs=TP, start_method="spawn")
        out = json.loads(Path(outdir, "verify.json").read_text())
    print(out["audit"])  # the mismatch report was logged by check_after_refit
    print(f"a refit with layer 0's gate and up swapped: {out['caught'] or 'NOT caught'}")
    return 0 if out["ok"] and out["audited"] and out["caught"] else 1


if __name__ == "__main__":
    sys.exit(main())
