"""The reference side of a mismatch check from an HF checkpoint or model (scored by transformers here), and the
token sequences to score; `reshard verify` (reshard.cli) compares it with a running `vllm serve`:

    reshard verify --checkpoint DIR --server http://127.0.0.1:8000 [--dtype bfloat16] [--sequences 4 --length 32]

prints the report (or JSON) and exits 1 above the dtype's thresholds."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Sequence

from ..errors import ArgumentError
from .metrics import Scores
from .sides import check_sequences, next_token_scores


def random_sequences(vocab_size: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """Token sequences to score for a mismatch check, the same for a given seed.

    Ids are uniform over the vocabulary; the first two sequences include its last ids (a wrong padding loses them).

    Args:
        vocab_size: the canonical vocabulary size (2 or more).
        count: how many sequences (1 or more).
        length: tokens per sequence (2 or more).
        seed: the random seed.

    Returns:
        `count` lists of `length` token ids.

    Raises:
        ArgumentError: a size is out of range.
    """
    for name, value, least in (("vocab_size", vocab_size, 2), ("count", count, 1), ("length", length, 2)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ArgumentError(name, value, f"must be an integer >= {least}")
    rng = random.Random(seed)
    out = [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]
    for s in out[:2]:
        s[1::4] = [vocab_size - 1 - (i % 8) for i in range(len(s[1::4]))]
    return out


def hf_model_scores(model: Any, sequences: Sequence[Sequence[int]]) -> Scores:
    """A transformers causal LM's scores of `sequences` (float32 log-softmax over the canonical vocabulary).

    Args:
        model: a transformers causal LM (any dtype, on any device).
        sequences: token-id sequences of 2+ tokens.

    Returns:
        Per sequence, the log-probability of each token after the first and the argmax there.

    Raises:
        ArgumentError: a sequence is shorter than 2 tokens or holds ids outside the vocabulary.
    """
    import torch

    vocab = model.config.get_text_config().vocab_size
    seqs = check_sequences(sequences, vocab)
    device = next(model.parameters()).device
    with torch.no_grad():
        rows = [next_token_scores(model(torch.tensor([seq], device=device)).logits[0, :-1, :vocab], seq)
                for seq in seqs]
    return Scores.rows(rows)


def checkpoint_scores(path: str | Path, sequences: Sequence[Sequence[int]]) -> Scores:
    """`hf_model_scores` of the HF checkpoint at `path` (loaded in float32, eager attention).

    Args:
        path: an HF checkpoint directory (config.json and safetensors).
        sequences: as for `hf_model_scores`.

    Returns:
        As `hf_model_scores`.

    Raises:
        ArgumentError: as `hf_model_scores`.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    return hf_model_scores(model, sequences)


__all__ = ["checkpoint_scores", "hf_model_scores", "random_sequences"]
