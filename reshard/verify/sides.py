"""The two sides' scores of the same token sequences (reshard.verify.metrics.Scores).

Trainer: a live megatron-core GPT model on its ranks (the model chunks of this rank); every rank of the model
calls `trainer_scores` together (pipeline stages pass activations, tensor-parallel logits are gathered); rank 0
computes log-softmax in float32 over the canonical vocabulary (the padded rows are not the model's tokens).
No vLLM is imported; the forward is megatron-core's own (reshard.adapters.megatron.forward_logits: pipeline
stages by point-to-point sends, an explicit causal mask on the tokens' device).
Engine: anything with `prompt_logprobs(prompts)` answering (logprobs, argmax) per prompt (a Scorer):
reshard.adapters.server.VllmServer for a `vllm serve`, reshard.verify.engines.LLMScorer for an in-process
`vllm.LLM`, reshard.adapters.ray.RayEngineClient for a Ray engine actor.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

from ..errors import ArgumentError
from .metrics import Scores


class Scorer(Protocol):
    """The engine side of a mismatch check: anything that scores prompts as the engine computes."""

    def prompt_logprobs(self, prompts: list[list[int]]) -> list[tuple[list[float], list[int]]]:
        """Per prompt, (log-probability, argmax token) at every position after the first."""


def check_sequences(sequences: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    """`sequences` as lists of ints, refused (ArgumentError) unless each has 2+ ids, all in the vocabulary."""
    out = [[int(t) for t in s] for s in sequences]
    if not out or any(len(s) < 2 for s in out):
        raise ArgumentError("sequences", [len(s) for s in out], "must be one or more sequences of 2+ token ids")
    bad = sorted({t for s in out for t in s if not 0 <= t < vocab_size})
    if bad:
        raise ArgumentError("sequences", bad[:8], f"hold token ids outside the vocabulary [0, {vocab_size})")
    return out


def trainer_scores(chunks: list[Any], sequences: Sequence[Sequence[int]], vocab_size: int) -> Scores | None:
    """megatron-core's scores of `sequences`, collective over the model's ranks (every rank calls it together).

    Args:
        chunks: this rank's model chunks (megatron-core GPTModels holding the trainer's current weights).
        sequences: token-id sequences of 2+ tokens, the same on every rank.
        vocab_size: the canonical vocabulary; the model's output may be padded past it, those rows are dropped
            before the log-softmax. The chunks are scored in eval mode (no dropout), their mode restored after.

    Returns:
        Scores (float32 log-probabilities of each next token and the argmax, per scored position) on global rank
        0; None on the other ranks.

    Raises:
        ArgumentError: a sequence is shorter than 2 tokens or holds ids outside [0, vocab_size).
    """
    import torch

    from ..adapters.megatron.forward import forward_logits

    seqs = check_sequences(sequences, vocab_size)
    logprobs, argmax = [], []
    device = next(chunks[0].parameters()).device
    training = [c.training for c in chunks]
    for c in chunks:  # the engine has no dropout: score in eval mode, then give the trainer its mode back
        c.eval()
    try:
        for seq in seqs:
            logits = forward_logits(chunks, torch.tensor([seq], device=device))
            if logits is None:
                continue
            lp = torch.log_softmax(logits[0, :-1, :vocab_size].float(), dim=-1)
            nxt = torch.tensor(seq[1:], device=lp.device)
            logprobs.append(lp.gather(1, nxt[:, None])[:, 0].tolist())
            argmax.append(lp.argmax(-1).tolist())
    finally:
        for c, mode in zip(chunks, training):
            c.train(mode)
    return Scores.of(logprobs, argmax) if logprobs else None


def engine_scores(engine: Scorer, sequences: Sequence[Sequence[int]]) -> Scores:
    """The engine's scores of `sequences` (asked in one call).

    Args:
        engine: a Scorer: a VllmServer, an LLMScorer, a RayEngineClient.
        sequences: token-id sequences of 2+ tokens.

    Returns:
        Its log-probabilities and argmax tokens.

    Raises:
        ArgumentError: the engine answered rows of unequal lengths.
    """
    rows = engine.prompt_logprobs([list(s) for s in sequences])
    return Scores.of([r[0] for r in rows], [r[1] for r in rows])


__all__ = ["Scorer", "check_sequences", "engine_scores", "trainer_scores"]
