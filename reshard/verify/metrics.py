"""Train-inference mismatch, the numbers (numpy only: no torch, no processes). With r_i = lp_trainer - lp_engine at each
scored position, the per-token KL(engine || trainer) estimates RL stacks log are k1 = -r_i and
k3 = exp(r_i) - 1 - r_i (Schulman's unbiased, non-negative estimator); argmax agreement compares both sides'
most likely next token.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

from ..errors import ArgumentError


@dataclass(frozen=True)
class Scores:
    """One side's scoring of sequences, per sequence and scored position (every token but the first).

    Attributes:
        logprobs: the log-probability of the token at each position, given those before it.
        argmax: the most likely token at each position.
    """

    logprobs: tuple[tuple[float, ...], ...]
    argmax: tuple[tuple[int, ...], ...]

    @staticmethod
    def of(logprobs: Sequence[Sequence[float]], argmax: Sequence[Sequence[int]]) -> "Scores":
        """Scores from any nested sequences (tensors' `tolist()`, JSON), refusing rows of unequal lengths."""
        lp = tuple(tuple(float(x) for x in row) for row in logprobs)
        am = tuple(tuple(int(x) for x in row) for row in argmax)
        if [len(r) for r in lp] != [len(r) for r in am]:
            raise ArgumentError("argmax", [len(r) for r in am], f"must have the lengths of logprobs "
                                f"{[len(r) for r in lp]}")
        return Scores(lp, am)

    @staticmethod
    def rows(rows: Sequence[tuple[Sequence[float], Sequence[int]]]) -> "Scores":
        """Scores from one (logprobs, argmax) pair per sequence, as `of` checks them."""
        return Scores.of([r[0] for r in rows], [r[1] for r in rows])

    def flat(self) -> list[float]:
        """Every log-probability, sequence after sequence."""
        return [x for row in self.logprobs for x in row]


@dataclass(frozen=True)
class Thresholds:
    """What a correct refit stays under (the baselines: BENCHMARKS.md, Mismatch).

    Attributes:
        max_abs: the largest per-token |log-prob difference|.
        mean_k3: the largest mean of the k3 KL estimate.
        min_argmax_agreement: the smallest fraction of positions where both sides' argmax agree.
    """

    max_abs: float
    mean_k3: float
    min_argmax_agreement: float


# The baselines: BENCHMARKS.md, Mismatch. float32 sides differ only by operation order: the limits sit far above a
# correct refit and far below the smallest planted bug. A correct bf16 refit differs a lot (8-bit mantissas, logits
# of tens of nats): its limits catch gross bugs only (experts, heads, halves, shards); the audit is for small ones.
THRESHOLDS = {
    "float32": Thresholds(max_abs=1e-3, mean_k3=1e-7, min_argmax_agreement=0.99),
    "bfloat16": Thresholds(max_abs=2.0, mean_k3=0.05, min_argmax_agreement=0.9),
}


def thresholds(dtype: str) -> Thresholds:
    """The thresholds for an engine computing in `dtype`.

    Args:
        dtype: "float32" or "bfloat16", as torch prints them ("torch.bfloat16") or short ("fp32", "bf16").

    Returns:
        The entry of THRESHOLDS.

    Raises:
        ArgumentError: a dtype without thresholds.
    """
    return THRESHOLDS[dtype_key(dtype, THRESHOLDS, "mismatch thresholds")]


def dtype_key(dtype: str, table: dict, what: str) -> str:
    """`dtype` as `table`'s key ("torch.bfloat16", "bf16" -> "bfloat16"); ArgumentError naming `what` if absent."""
    key = str(dtype).removeprefix("torch.")
    key = {"fp32": "float32", "bf16": "bfloat16", "float": "float32"}.get(key, key)
    if key not in table:
        raise ArgumentError("dtype", dtype, f"has no {what}; known: {sorted(table)}")
    return key


@dataclass(frozen=True)
class MismatchReport:
    """The comparison of one refit: per-token log-prob differences, KL estimates, argmax agreement, verdict.

    Attributes:
        dtype: the dtype whose thresholds applied.
        tokens: scored positions.
        mean_abs: mean of |lp_trainer - lp_engine| over them.
        max_abs: its largest value.
        p50_abs: its median.
        p90_abs: its 90th percentile.
        p99_abs: its 99th percentile.
        mean_k1: mean k1 KL estimate (module docstring).
        mean_k3: mean k3 KL estimate.
        argmax_agreement: fraction of positions where both sides' argmax agree.
        worst: (sequence, position) of the largest difference.
        thresholds: the thresholds applied.
        failures: what broke them (empty: within thresholds).
    """

    dtype: str
    tokens: int
    mean_abs: float
    max_abs: float
    p50_abs: float
    p90_abs: float
    p99_abs: float
    mean_k1: float
    mean_k3: float
    argmax_agreement: float
    worst: tuple[int, int]
    thresholds: Thresholds
    failures: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """Within every threshold."""
        return not self.failures

    def to_dict(self) -> dict:
        """Plain JSON values, `ok` included (`from_dict` reads them back)."""
        return {**asdict(self), "ok": self.ok}

    @staticmethod
    def from_dict(d: dict) -> "MismatchReport":
        """The report `to_dict` wrote, after a JSON round trip (a broadcast, another process's output)."""
        d = {k: v for k, v in d.items() if k != "ok"}
        return MismatchReport(**{**d, "worst": tuple(d["worst"]), "thresholds": Thresholds(**d["thresholds"]),
                                 "failures": tuple(d["failures"])})

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "MISMATCH: " + "; ".join(self.failures)
        return (f"train-inference mismatch ({self.dtype}, {self.tokens} tokens): |dlogp| mean {self.mean_abs:.2e} "
                f"p50 {self.p50_abs:.2e} p90 {self.p90_abs:.2e} p99 {self.p99_abs:.2e} max {self.max_abs:.2e}; "
                f"KL k1 {self.mean_k1:.2e} k3 {self.mean_k3:.2e}; argmax agree {self.argmax_agreement:.3f} "
                f"-> {verdict}")


def compare(trainer: Scores, engine: Scores, dtype: str = "float32",
            limits: Thresholds | None = None) -> MismatchReport:
    """Compare the two sides' scores of the same sequences.

    Args:
        trainer: the trainer's scores.
        engine: the engine's scores of the same positions.
        dtype: the dtype the engine computes in; picks the thresholds.
        limits: thresholds to apply instead of `dtype`'s.

    Returns:
        The statistics and the thresholds they broke.

    Raises:
        ArgumentError: the two sides scored other positions, none at all, or `dtype` has no thresholds.
    """
    limits = limits or thresholds(dtype)
    lengths = [len(r) for r in trainer.logprobs]
    if lengths != [len(r) for r in engine.logprobs]:
        raise ArgumentError("engine scores", [len(r) for r in engine.logprobs],
                            f"must score the positions the trainer scored {lengths}")
    r = np.array(trainer.flat(), dtype=np.float64) - np.array(engine.flat(), dtype=np.float64)
    if not r.size:
        raise ArgumentError("sequences", 0, "must hold at least one scored position (sequences of 2+ tokens)")
    n, diffs = r.size, np.abs(r)
    worst = int(np.argmax(diffs))
    seq = int(np.searchsorted(np.cumsum(lengths), worst, side="right"))  # the sequence holding position `worst`
    agree = np.array([x for row in trainer.argmax for x in row]) == np.array([x for row in engine.argmax for x in row])
    p50, p90, p99 = np.percentile(diffs, [50, 90, 99]).tolist()
    stats = dict(mean_abs=float(diffs.mean()), max_abs=float(diffs[worst]), p50_abs=p50, p90_abs=p90, p99_abs=p99,
                 mean_k1=float(-r.mean()), mean_k3=float((np.expm1(np.minimum(r, 50.0)) - r).mean()),
                 argmax_agreement=float(agree.mean()))
    failures = [(not np.isfinite(diffs).all(), "non-finite log-probabilities"),
                (stats["max_abs"] > limits.max_abs, f"max |dlogp| {stats['max_abs']:.3e} > {limits.max_abs:.1e}"),
                (stats["mean_k3"] > limits.mean_k3, f"mean KL (k3) {stats['mean_k3']:.3e} > {limits.mean_k3:.1e}"),
                (stats["argmax_agreement"] < limits.min_argmax_agreement,
                 f"argmax agreement {stats['argmax_agreement']:.3f} < {limits.min_argmax_agreement}")]
    return MismatchReport(dtype=str(dtype), tokens=n, worst=(seq, worst - sum(lengths[:seq])), thresholds=limits,
                          failures=tuple(why for failed, why in failures if failed), **stats)


__all__ = ["MismatchReport", "Scores", "THRESHOLDS", "Thresholds", "compare", "thresholds"]
