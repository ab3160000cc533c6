"""The mismatch check after a refit: score the same sequences on the trainer (collective over its ranks) and on
the engine (rank 0 asks it), compare, and give every rank the same report, so all can stop together.

    check_after_refit(chunks, server, sequences, vocab_size=spec.vocab_size)   # raises MismatchError above threshold
"""
from __future__ import annotations

from typing import Any, Sequence

from ..errors import MismatchError
from .metrics import MismatchReport, Thresholds, compare
from ..group_json import broadcast_json
from .sides import Scorer, engine_scores, global_rank, trainer_scores


def report_from_dict(d: dict) -> MismatchReport:
    """The report `MismatchReport.to_dict` wrote, after a JSON round trip (a broadcast, another process's output)."""
    d = {k: v for k, v in d.items() if k != "ok"}
    return MismatchReport(**{**d, "worst": tuple(d["worst"]), "thresholds": Thresholds(**d["thresholds"]),
                             "failures": tuple(d["failures"])})


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
    return report_from_dict(payload)


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


__all__ = ["check_after_refit", "measure", "report_from_dict"]
