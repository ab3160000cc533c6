"""`reshard verify`: the mismatch between an HF checkpoint (scored by transformers in this process, no vLLM) and a
running `vllm serve` that should serve those weights (after a refit from a trainer that saved them, or fresh).

    reshard verify --checkpoint DIR --server http://127.0.0.1:8000 [--dtype bfloat16] [--sequences 4 --length 32]

Prints the report (or JSON) and exits 1 above the dtype's thresholds."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Sequence

from ..errors import ArgumentError
from .metrics import MismatchReport, Scores, compare
from .sides import check_sequences, engine_scores


def random_sequences(vocab_size: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """`count` sequences of `length` token ids drawn uniformly from the vocabulary (the first two include its
    last ids, whose rows a wrong vocabulary padding would lose)."""
    rng = random.Random(seed)
    out = [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]
    for s in out[:2]:
        s[1::4] = [vocab_size - 1 - (i % 8) for i in range(len(s[1::4]))]
    return out


def checkpoint_scores(path: str | Path, sequences: Sequence[Sequence[int]]) -> Scores:
    """transformers' scores of `sequences` on the checkpoint at `path` (float32, eager attention)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    vocab = model.config.get_text_config().vocab_size
    seqs = check_sequences(sequences, vocab)
    logprobs, argmax = [], []
    with torch.no_grad():
        for seq in seqs:
            logits = model(torch.tensor([seq])).logits[0, :-1, :vocab].float()
            lp = torch.log_softmax(logits, dim=-1)
            logprobs.append(lp.gather(1, torch.tensor(seq[1:])[:, None])[:, 0].tolist())
            argmax.append(lp.argmax(-1).tolist())
    return Scores.of(logprobs, argmax)


def verify_checkpoint(path: str | Path, server: Any, *, dtype: str = "float32", count: int = 4, length: int = 32,
                      seed: int = 0) -> MismatchReport:
    config = json.loads(Path(path, "config.json").read_text())
    vocab = (config.get("text_config") or config).get("vocab_size")
    if not isinstance(vocab, int) or vocab < 2:
        raise ArgumentError("vocab_size", vocab, f"of {path}/config.json must be an integer >= 2")
    seqs = random_sequences(vocab, count, length, seed)
    return compare(checkpoint_scores(path, seqs), engine_scores(server, seqs), dtype)


def main_verify(args: Any) -> int:
    from ..adapters.server import VllmServer

    report = verify_checkpoint(args.checkpoint, VllmServer(args.server), dtype=args.dtype, count=args.sequences,
                               length=args.length, seed=args.seed)
    print(json.dumps(report.to_dict()) if args.json else str(report))
    return 0 if report.ok else 1


__all__ = ["checkpoint_scores", "main_verify", "random_sequences", "verify_checkpoint"]
