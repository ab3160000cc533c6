"""Slice-sensitivity audit: does every trainer tensor's slice reach the engine where the trainer uses it?

A mismatch check cannot see a dropped slice whose bytes the engine already held, nor say which tensor was wrong.
The audit perturbs rows spread over one trainer tensor at a time (each row by its own seeded noise, so swapped rows
or halves differ), refits, and compares the change of every scored log-probability on both sides: a slice that
landed where the trainer has it moves the engine as it moved the trainer; a dropped one does not move it; a
misplaced one moves it elsewhere. Collective over the trainer ranks; one refit and one scoring per tensor; the
weights are restored (and refit) at the end.
"""
from __future__ import annotations

import math
import re
import zlib
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

from ..errors import ArgumentError, MismatchError
from ..group_json import broadcast_json
from .metrics import dtype_key
from .sides import Scorer, engine_scores, global_rank, trainer_scores

# relative response error |d_engine - d_trainer| / |d_trainer| a correctly placed slice stays under (BENCHMARKS.md,
# Mismatch); responses under FLOOR (nats, l2 over all scored tokens) on both sides say nothing.
RESPONSE_TOL = {"float32": 0.02, "bfloat16": 0.3}  # bf16: no baseline yet (needs a bf16 megatron-core trainer on CPU)
FLOOR = {"float32": 1e-3, "bfloat16": 0.2}


@dataclass(frozen=True)
class AuditEntry:
    """How the engine responded to the perturbation of one trainer tensor, beside the trainer's response.

    Attributes:
        tensor: the source tensor perturbed.
        status: "ok", "MOVED WRONGLY", "NOT DELIVERED" (the engine did not move) or "no response" (neither side
            moved: inconclusive).
        relative_error: |engine response - trainer response| / |trainer response|.
        trainer_response: l2 change of the trainer's log-probabilities over all scored tokens.
        engine_response: the same on the engine.
    """

    tensor: str
    status: str
    relative_error: float
    trainer_response: float
    engine_response: float


@dataclass(frozen=True)
class AuditReport:
    """The outcome of one `audit`.

    Attributes:
        dtype: the dtype whose tolerances applied.
        entries: one per audited tensor, in audit order.
    """

    dtype: str
    entries: tuple[AuditEntry, ...]

    @property
    def failed(self) -> tuple[str, ...]:
        """The tensors that moved wrongly or were not delivered."""
        return tuple(e.tensor for e in self.entries if e.status in ("MOVED WRONGLY", "NOT DELIVERED"))

    @property
    def ok(self) -> bool:
        """No tensor failed ("no response" is not a failure)."""
        return not self.failed

    def to_dict(self) -> dict:
        """Plain JSON values, `failed` included."""
        return {"dtype": self.dtype, "entries": [asdict(e) for e in self.entries], "failed": list(self.failed)}

    def __str__(self) -> str:
        lines = [f"slice-sensitivity audit ({self.dtype}): {len(self.entries)} tensors, "
                 + ("all reached the engine where the trainer uses them" if self.ok else
                    f"{len(self.failed)} wrong: {', '.join(self.failed)}")]
        lines += [f"  {e.status:<13} {e.tensor}  rel.err {e.relative_error:.2e}  |d trainer| {e.trainer_response:.2e}"
                  f"  |d engine| {e.engine_response:.2e}" for e in self.entries]
        return "\n".join(lines)


def tensor_kind(name: str) -> str:
    """A tensor's kind: its name with every dotted number (layer, expert) replaced by `*`.

    Args:
        name: a tensor name ("decoder.layers.3.mlp.experts.7.weight" -> "decoder.layers.*.mlp.experts.*.weight").

    Returns:
        The kind.

    Raises:
        TypeError: `name` is not a string.
    """
    return re.sub(r"\.\d+\.", ".*.", re.sub(r"\.\d+\.", ".*.", name))


def sample_by_kind(names: Sequence[str]) -> list[str]:
    """One tensor of each kind (`tensor_kind`), the one with the lowest indices: what `audit` perturbs by default.

    Args:
        names: tensor names.

    Returns:
        The chosen names, sorted.

    Raises:
        TypeError: a name is not a string.
    """
    seen: dict[str, str] = {}
    for n in sorted(names, key=lambda n: (tuple(int(p) for p in n.split(".") if p.isdigit()), n)):
        seen.setdefault(tensor_kind(n), n)
    return sorted(seen.values())


def slice_rows(shape: Sequence[int], rows: int) -> list[int]:
    """`rows` row indices spread over the first dimension, the first and the last included."""
    n, k = shape[0], min(rows, shape[0])
    return sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(k)})


def perturbation(name: str, t: Any, rows: list[int]) -> Any:
    """Seeded noise (by name: every rank holding the tensor draws the same) of the rows' own scale."""
    import torch

    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    sub = t[rows].float()
    scale = float(sub.pow(2).mean().sqrt()) or 1.0
    return (torch.randn(sub.shape, generator=gen) * scale).to(t.dtype)


def audit(chunks: list[Any], tensors: dict[str, Any], refit: Callable[[], Any], engine: Scorer | None,
          sequences: Sequence[Sequence[int]], *, vocab_size: int, dtype: str = "float32",
          names: Sequence[str] | None = None, rows: int = 8, tol: float | None = None,
          group: Any = None) -> AuditReport:
    """Perturb one trainer tensor at a time, refit, and check the engine responds as the trainer does.

    Collective: every rank calls it with the same arguments; afterwards the weights are as before, and refit.

    Args:
        chunks: this rank's megatron-core model chunks.
        tensors: this rank's live source tensors (views of the chunks' parameters) by name.
        refit: the caller's refit of the engine from `tensors`.
        engine: what scores on the engine side (needed on global rank 0 only).
        sequences: token sequences to score.
        vocab_size: the model's vocabulary size (unpadded).
        dtype: the dtype the engine computes in; picks the tolerances (`tol` overrides).
        names: the tensors to audit (default: `sample_by_kind` of every rank's tensor names).
        rows: rows perturbed per tensor, spread over its first dimension.
        tol: the relative response error a correctly placed slice stays under.
        group: the trainer's process group (default: the world).

    Returns:
        The same report on every rank (`check_audit` raises on a failed one).

    Raises:
        ArgumentError: a dtype without tolerances, or `names` that are no rank's source tensors.
    """
    import torch
    import torch.distributed as dist

    key = dtype_key(dtype, RESPONSE_TOL, "audit tolerance")
    tol = RESPONSE_TOL[key] if tol is None else tol
    ranks = range(dist.get_world_size(group) if dist.is_initialized() else 1)  # every rank's tensor names
    everything = sorted(set().union(*(broadcast_json(sorted(tensors), group, what=f"rank {src}'s tensor names",
                                                     src=src) for src in ranks)))
    chosen = list(names) if names is not None else sample_by_kind(everything)
    unknown = sorted(set(chosen) - set(everything))
    if unknown:
        raise ArgumentError("names", unknown[:8], "are not source tensors on any trainer rank")
    rank0 = global_rank() == 0

    def scores() -> tuple[list[float], list[float]]:
        mine = trainer_scores(chunks, sequences, vocab_size)
        theirs = engine_scores(engine, sequences) if rank0 else None
        return (mine.flat(), theirs.flat()) if rank0 else ([], [])

    refit()
    base_t, base_e = scores()
    entries = []
    try:
        for name in chosen:
            t = tensors.get(name)
            r = slice_rows(t.shape, rows) if t is not None else []
            kept = t[r].clone() if t is not None else None
            try:
                with torch.no_grad():
                    if t is not None:
                        t[r] += perturbation(name, t, r)
                refit()
                now_t, now_e = scores()
            finally:
                with torch.no_grad():
                    if t is not None:
                        t[r] = kept
            entry = None
            if rank0:
                dt = [a - b for a, b in zip(now_t, base_t)]
                de = [a - b for a, b in zip(now_e, base_e)]
                nt, ne = math.sqrt(sum(x * x for x in dt)), math.sqrt(sum(x * x for x in de))
                rel = math.sqrt(sum((a - b) ** 2 for a, b in zip(de, dt))) / max(nt, FLOOR[key])
                if nt < FLOOR[key] and ne < FLOOR[key]:
                    status = "no response"
                elif ne < FLOOR[key] or ne < 0.1 * nt and rel > tol:
                    status = "NOT DELIVERED"
                else:
                    status = "ok" if rel <= tol else "MOVED WRONGLY"
                entry = asdict(AuditEntry(name, status, rel, nt, ne))
            entries.append(AuditEntry(**broadcast_json(entry, group, what="an audit entry from rank 0")))
    finally:
        refit()
    return AuditReport(key, tuple(entries))


def check_audit(report: AuditReport) -> AuditReport:
    """Fail on an audit that found misplaced or undelivered tensors.

    Args:
        report: an `audit`'s report.

    Returns:
        `report`, when no tensor failed.

    Raises:
        MismatchError: a tensor failed (the report attached).
    """
    if not report.ok:
        raise MismatchError(str(report), report)
    return report


__all__ = ["AuditEntry", "AuditReport", "audit", "check_audit", "sample_by_kind", "slice_rows", "tensor_kind"]
