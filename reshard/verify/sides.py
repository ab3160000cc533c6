"""The two sides' scores of the same token sequences (reshard.verify.metrics.Scores): the trainer's, from a live
megatron-core model (collective over its ranks; reshard.adapters.megatron.forward_logits; no vLLM), and the
engine's, from any Scorer (VllmServer, LLMScorer, RayEngineClient); and the mismatch check after a refit, which
compares them on rank 0 and gives every rank the same report, so all can stop together.

    check_after_refit(chunks, server, sequences, vocab_size=spec.vocab_size)   # raises MismatchError above threshold
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

from ..errors import ArgumentError, MismatchError
from ..group_json import broadcast_json
from .metrics import MismatchReport, Scores, Thresholds, compare


class Scorer(Protocol):
    """The engine side of a mismatch check: anything that scores prompts as the engine computes."""

    def prompt_logprobs(self, prompts: list[list[int]]) -> list[tuple[list[float], list[int]]]:
        """Per prompt, (log-probability, argmax token) at every position after the first."""


def global_rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def check_sequences(sequences: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    """`sequences` as lists of ints, refused (ArgumentError) unless each has 2+ ids, all in the vocabulary."""
    out = [[int(t) for t in s] for s in sequences]
    if not out or any(len(s) < 2 for s in out):
        raise ArgumentError("sequences", [len(s) for s in out], "must be one or more sequences of 2+ token ids")
    bad = sorted({t for s in out for t in s if not 0 <= t < vocab_size})
    if bad:
        raise ArgumentError("sequences", bad[:8], f"hold token ids outside the vocabulary [0, {vocab_size})")
    return out


def next_token_scores(logits: Any, seq: Sequence[int]) -> tuple[list[float], list[int]]:
    """One sequence's float32 log-probability of each token after the first, and the argmax there, from its logits
    at the positions before ([len(seq) - 1, vocab])."""
    import torch

    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp.gather(1, torch.tensor(seq[1:], device=lp.device)[:, None])[:, 0].tolist(), lp.argmax(-1).tolist()


def trainer_scores(chunks: list[Any], sequences: Sequence[Sequence[int]], vocab_size: int) -> Scores | None:
    """megatron-core's scores of `sequences`, collective over the model's ranks, in eval mode (mode restored).

    Args:
        chunks: this rank's model chunks (megatron-core GPTModels holding the trainer's current weights).
        sequences: token-id sequences of 2+ tokens, the same on every rank.
        vocab_size: the canonical vocabulary (padded output rows are dropped before the log-softmax).

    Returns:
        Scores on global rank 0 (float32 log-probabilities and argmax per scored position); None elsewhere.

    Raises:
        ArgumentError: a sequence is shorter than 2 tokens or holds ids outside [0, vocab_size).
    """
    import torch

    from ..adapters.megatron.forward import forward_logits

    seqs = check_sequences(sequences, vocab_size)
    rows = []
    device = next(chunks[0].parameters()).device
    training = [c.training for c in chunks]
    for c in chunks:  # the engine has no dropout: score in eval mode, then give the trainer its mode back
        c.eval()
    try:
        for seq in seqs:
            logits = forward_logits(chunks, torch.tensor([seq], device=device))
            if logits is not None:
                rows.append(next_token_scores(logits[0, :-1, :vocab_size], seq))
    finally:
        for c, mode in zip(chunks, training):
            c.train(mode)
    return Scores.rows(rows) if rows else None


def engine_scores(engine: Scorer, sequences: Sequence[Sequence[int]]) -> Scores:
    """The engine's scores of `sequences`, asked in one call.

    Args:
        engine: a Scorer (VllmServer, LLMScorer, RayEngineClient).
        sequences: token-id sequences of 2+ tokens.

    Returns:
        Its log-probabilities and argmax tokens.

    Raises:
        ArgumentError: the engine answered rows of unequal lengths.
    """
    return Scores.rows(engine.prompt_logprobs([list(s) for s in sequences]))


def measure(chunks: list[Any], engine: Scorer | None, sequences: Sequence[Sequence[int]], *, vocab_size: int,
            dtype: str = "float32", limits: Thresholds | None = None, group: Any = None) -> MismatchReport:
    """How far the engine's log-probabilities are from the trainer's, after a refit (collective over the ranks).

    Args:
        chunks: the trainer's megatron-core model chunks on this rank.
        engine: what scores on the engine side (needed on global rank 0 only).
        sequences: token sequences to score.
        vocab_size: the model's vocabulary size (unpadded).
        dtype: the dtype the engine computes in; picks the thresholds (`limits` overrides them).
        limits: thresholds to apply instead of `dtype`'s.
        group: the process group to share the report over (default: the world).

    Returns:
        The same report on every rank.

    Raises:
        MismatchError: rank 0 could not measure (the engine failed, or the scores do not match up).
    """
    mine = trainer_scores(chunks, sequences, vocab_size)
    payload = None
    if global_rank() == 0:
        try:
            payload = compare(mine, engine_scores(engine, sequences), dtype, limits).to_dict()
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, or the others wait forever
            payload = {"error": f"{type(exc).__name__}: {exc}"}
    payload = broadcast_json(payload, group, what="the mismatch report from rank 0")
    if "error" in payload:
        raise MismatchError(f"the mismatch could not be measured: {payload['error']}")
    return MismatchReport.from_dict(payload)


def check_after_refit(chunks: list[Any], engine: Scorer | None, sequences: Sequence[Sequence[int]], *,
                      vocab_size: int, dtype: str = "float32", limits: Thresholds | None = None,
                      group: Any = None, log: Any = print) -> MismatchReport:
    """`measure`, logged on rank 0, failing on every rank beyond the thresholds: what an RL loop calls after a refit.

    Args:
        log: a print-like function for the report on rank 0, or None; the other arguments as for `measure`.

    Returns:
        The report, within thresholds.

    Raises:
        MismatchError: beyond the thresholds (the report attached), or not measured.
    """
    report = measure(chunks, engine, sequences, vocab_size=vocab_size, dtype=dtype, limits=limits, group=group)
    if log is not None and global_rank() == 0:
        log(str(report))
    if not report.ok:
        raise MismatchError(str(report), report)
    return report


__all__ = ["Scorer", "check_after_refit", "check_sequences", "engine_scores", "measure", "trainer_scores"]
