"""Which logical expert each physical expert slot of an expert-parallel engine holds: vLLM's EPLB placement.

EPLB keeps a MoE layer's E logical experts in P >= E physical slots, rank r holding slots [r P/ranks,
(r+1) P/ranks) as the rows of its stacked expert tensors; a logical expert in several slots has replicas. vLLM
loads by its initial placement (slot e < E holds expert e, slot E + i expert i mod E) and rebalances while
serving. An `ExpertPlacement` is that map as a validated, canonical (identical rows are one row) frozen value
with a digest, so a plan compiled for one placement is never taken for another's."""
from __future__ import annotations

import functools
import hashlib
import json
from typing import Any, ClassVar

import numpy as np
from pydantic import ConfigDict, StrictInt, model_validator

from ..errors import ArgumentError
from ..limits import MAX_EXPERTS, MAX_LAYERS, MAX_RANKS, check_limit
from .validated import ValidatedModel

WHERE = "expert placement"


class ExpertPlacement(ValidatedModel):
    """Per MoE layer, the logical expert of every physical slot of an expert-parallel engine.

    Args:
        ranks: the EP ranks the physical slots are spread over evenly.
        logical_experts: the model's (routed) experts, E.
        physical_to_logical: per MoE layer, the logical expert in each physical slot (vLLM's
            `physical_to_logical_map`); a single row stands for every MoE layer.

    Raises:
        ArgumentError: a map that is not a permutation with replicas of the logical experts, rows of different
            lengths, or a slot count that the ranks do not divide.
        LimitError: counts beyond `reshard.limits`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    error_where: ClassVar[str] = "expert_placement"

    ranks: StrictInt
    logical_experts: StrictInt
    physical_to_logical: tuple[tuple[StrictInt, ...], ...]

    @model_validator(mode="wrap")
    @classmethod
    def _one_row_if_uniform(cls, data: Any, handler: Any) -> "ExpertPlacement":
        """Canonical form: identical rows are one row, so one placement has one value (and one digest)."""
        if isinstance(data, dict) and not all(isinstance(k, str) for k in data):  # pydantic would spread it
            raise ArgumentError("expert_placement", data, "must be an ExpertPlacement or its fields by name",
                                where=WHERE)
        placement = handler(data)
        rows = placement.physical_to_logical
        if len(rows) > 1 and all(r == rows[0] for r in rows[1:]):
            return handler({"ranks": placement.ranks, "logical_experts": placement.logical_experts,
                            "physical_to_logical": rows[:1]})
        return placement

    @model_validator(mode="after")
    def _validate(self) -> "ExpertPlacement":
        _check_counts(ranks=self.ranks, logical_experts=self.logical_experts)
        rows = self.physical_to_logical
        if not rows:
            raise ArgumentError("physical_to_logical", rows, "must have a row per MoE layer (or one for all)",
                                where=WHERE)
        check_limit("physical_to_logical (rows)", len(rows), MAX_LAYERS, "layers", WHERE)
        lengths = sorted({len(r) for r in rows})
        if len(lengths) > 1:
            raise ArgumentError("physical_to_logical", f"rows of {lengths} slots",
                                "must give every MoE layer the same number of physical slots", where=WHERE)
        P = lengths[0]
        check_limit("physical slots", P, MAX_EXPERTS, "experts", WHERE)
        if P < self.logical_experts:
            raise ArgumentError("physical_to_logical", f"{P} slots per layer",
                                f"must hold each of the {self.logical_experts} logical experts at least once",
                                where=WHERE)
        if P % self.ranks:
            raise ArgumentError("physical_to_logical", f"{P} slots per layer",
                                f"must split evenly over ranks={self.ranks} (EPLB gives every EP rank the same "
                                f"number of slots)", where=WHERE)
        problems = _map_problems(np.asarray(rows, dtype=np.int64), self.logical_experts)
        if problems:
            raise ArgumentError("physical_to_logical", f"<{len(rows)} x {P} map>",
                                f"must place logical experts 0..{self.logical_experts - 1} in the slots, each at "
                                f"least once (a permutation with replicas): " + "; ".join(problems), where=WHERE)
        return self

    @property
    def num_physical(self) -> int:
        """Physical slots per MoE layer, P."""
        return len(self.physical_to_logical[0])

    @property
    def slots_per_rank(self) -> int:
        """Physical slots each EP rank holds per MoE layer."""
        return self.num_physical // self.ranks

    @property
    def redundant(self) -> int:
        """Redundant experts: physical slots beyond one per logical expert (vLLM's num_redundant_experts)."""
        return self.num_physical - self.logical_experts

    @property
    def num_rows(self) -> int:
        """1 if every MoE layer has the same placement, else the number of MoE layers."""
        return len(self.physical_to_logical)

    def table(self) -> np.ndarray:
        """[rows, P] int64: the logical expert of each physical slot (read-only)."""
        return _table(self)

    @functools.cached_property
    def digest(self) -> str:
        """SHA-256 of the canonical JSON form: what names this placement in plans and errors."""
        return hashlib.sha256(json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    @property
    def is_initial(self) -> bool:
        """Whether this is the placement vLLM's weight loaders write (`initial`)."""
        return self == _initial(self.logical_experts, self.redundant, self.ranks)

    def __str__(self) -> str:
        layers = "every MoE layer alike" if self.num_rows == 1 else f"{self.num_rows} MoE layers"
        return (f"{self.logical_experts} experts in {self.num_physical} slots over {self.ranks} ranks "
                f"({self.redundant} redundant, {layers}; {self.digest[:12]})")

    @classmethod
    def initial(cls, logical_experts: int, redundant: int, ranks: int) -> "ExpertPlacement":
        """vLLM's initial placement, the one its weight loaders write: slot e < E holds expert e, slot E + i
        expert i mod E.

        Raises:
            ArgumentError: counts that are not integers, a negative `redundant`, or a slot count the ranks do not
                divide.
        """
        _check_counts(ranks=ranks, logical_experts=logical_experts)
        if isinstance(redundant, bool) or not isinstance(redundant, int) or redundant < 0:
            raise ArgumentError("redundant", redundant, "must be an integer at least 0", where=WHERE)
        check_limit("logical_experts + redundant", logical_experts + redundant, MAX_EXPERTS, "experts", WHERE)
        return _initial(logical_experts, redundant, ranks)

    @classmethod
    def from_vllm(cls, physical_to_logical: Any, *, ranks: int, logical_experts: int,
                  logical_to_physical: Any = None, logical_replica_count: Any = None) -> "ExpertPlacement":
        """The placement vLLM's EPLB state holds, from its maps (numpy arrays, nested lists, or tensors).

        Args:
            physical_to_logical: [layers, P] (or [P], every layer alike): the logical expert of each physical slot.
            ranks: the engine's EP size.
            logical_experts: the model's logical experts, E.
            logical_to_physical: optional [layers, E, K] (or [E, K]): each logical expert's slots, then -1 padding;
                checked against `physical_to_logical`.
            logical_replica_count: optional [layers, E] (or [E]): each logical expert's number of slots; checked
                likewise.

        Returns:
            The placement.

        Raises:
            ArgumentError: a map of the wrong shape or type, a map that is not a permutation with replicas, or maps
                that disagree (naming the map, the layer and the expert).
        """
        p2l = _int_array("physical_to_logical", physical_to_logical, 2)
        _check_counts(ranks=ranks, logical_experts=logical_experts)  # ArgumentErrors, not the constructor's
        placement = cls(ranks=ranks, logical_experts=logical_experts, physical_to_logical=p2l.tolist())
        layers, E = p2l.shape[0], logical_experts
        order, start, counts = _slot_lists(p2l, E)
        if logical_replica_count is not None:
            got = _int_array("logical_replica_count", logical_replica_count, 2)
            if got.shape != (layers, E):
                raise ArgumentError("logical_replica_count", f"shape {got.shape}", f"must be [{layers}, {E}] (layers "
                                    f"x logical experts), as physical_to_logical is", where=WHERE)
            bad = np.argwhere(got != counts)
            if len(bad):
                text = "; ".join(f"layer {m} expert {e}: {got[m, e]} replicas, but physical_to_logical puts it in "
                                 f"{counts[m, e]} slots {np.flatnonzero(p2l[m] == e).tolist()}" for m, e in bad[:3])
                raise ArgumentError("logical_replica_count", f"<{layers} x {E} counts>", "must count each expert's "
                                    "slots in physical_to_logical: " + text, where=WHERE)
        if logical_to_physical is not None:
            l2p = _int_array("logical_to_physical", logical_to_physical, 3)
            if l2p.shape[:2] != (layers, E):
                raise ArgumentError("logical_to_physical", f"shape {l2p.shape}", f"must be [{layers}, {E}, K] "
                                    f"(layers x logical experts x slots, -1 padded)", where=WHERE)
            bad = _slot_list_problems(l2p, p2l, order, start, counts)
            if bad:
                raise ArgumentError("logical_to_physical", f"<{'x'.join(map(str, l2p.shape))} map>", "must list "
                                    "each expert's slots of physical_to_logical, then -1 padding: " + "; ".join(bad),
                                    where=WHERE)
        return placement


def _map_problems(t: np.ndarray, E: int) -> list[str]:
    """What makes [rows, P] not a permutation with replicas of experts 0..E-1 (at most three)."""
    bad = np.argwhere((t < 0) | (t >= E))
    if len(bad):
        return [f"layer {m} slot {p} holds expert {t[m, p]}, outside [0, {E})" for m, p in bad[:3]]
    problems = []
    for m, row in enumerate(t):
        missing = np.flatnonzero(np.bincount(row, minlength=E) == 0)
        if len(missing):
            problems.append(f"layer {m} places no replica of experts {missing[:8].tolist()}"
                            + (f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""))
            if len(problems) == 3:
                break
    return problems


def _slot_list_problems(l2p: np.ndarray, p2l: np.ndarray, order: np.ndarray, start: np.ndarray,
                        counts: np.ndarray) -> list[str]:
    """Where logical -> physical [layers, E, K] does not list exactly each expert's slots of physical -> logical,
    then -1 (at most three; vectorized: layers x E runs to tens of thousands)."""
    layers, E, K = l2p.shape
    P = p2l.shape[1]
    big = P + 1
    expected = np.full((layers, E, max(K, int(counts.max()))), big, dtype=np.int64)
    expert_of = np.take_along_axis(p2l, order, axis=1)
    within = np.arange(P) - np.take_along_axis(start, expert_of, axis=1)
    expected[np.arange(layers)[:, None], expert_of, within] = order
    got = np.sort(np.where(l2p >= 0, l2p, big), axis=-1)
    valid = l2p >= 0
    wrong = ((counts > K) | np.any(got != expected[..., :K], axis=-1) | np.any(l2p < -1, axis=-1)
             | np.any(valid[..., 1:] & ~valid[..., :-1], axis=-1))
    return [f"layer {m} expert {e}: lists slots {l2p[m, e][l2p[m, e] != -1].tolist()}, but physical_to_logical "
            f"puts it in {np.flatnonzero(p2l[m] == e).tolist()}" for m, e in np.argwhere(wrong)[:3]]


def _check_counts(**counts: Any) -> None:
    """Refuse a count (`ranks`, `logical_experts`) that is not a positive integer within `reshard.limits`."""
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ArgumentError(name, value, "must be a positive integer", where=WHERE)
        check_limit(name, value, MAX_RANKS if name == "ranks" else MAX_EXPERTS, name.split("_")[-1], WHERE)


def _int_array(name: str, value: Any, ndim: int) -> np.ndarray:
    """An integer array of `ndim` (or `ndim` - 1) dimensions from a list, an array or a tensor."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor, without importing torch here
        value = value.detach().cpu().numpy()
    try:
        a = np.asarray(value)
    except (TypeError, ValueError) as e:
        raise ArgumentError(name, f"<{type(value).__name__}>", f"must be an array of integers ({e})",
                            where=WHERE) from None
    if a.ndim not in (ndim - 1, ndim) or a.dtype.kind not in "iu" or a.size == 0:
        raise ArgumentError(name, f"{a.dtype} of shape {a.shape}", f"must be a non-empty integer array of "
                            f"{ndim - 1} or {ndim} dimensions", where=WHERE)
    check_limit(f"{name} (entries)", int(a.size), MAX_LAYERS * MAX_EXPERTS, "entries", WHERE)
    return a.astype(np.int64).reshape((1,) * (ndim - a.ndim) + a.shape)


@functools.lru_cache(maxsize=64)
def _table(p: ExpertPlacement) -> np.ndarray:
    t = np.asarray(p.physical_to_logical, dtype=np.int64)
    t.setflags(write=False)
    return t


@functools.lru_cache(maxsize=64)
def _initial(E: int, R: int, ranks: int) -> ExpertPlacement:
    return ExpertPlacement(ranks=ranks, logical_experts=E,
                           physical_to_logical=(tuple(range(E)) + tuple(i % E for i in range(R)),))


def _slot_lists(t: np.ndarray, E: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each of the E experts' slots per row of [rows, P] as CSR (order, start, count), ascending within each."""
    order = np.argsort(t, axis=1, kind="stable")
    count = np.stack([np.bincount(r, minlength=E) for r in t])
    return order, np.cumsum(count, axis=1) - count, count


@functools.lru_cache(maxsize=64)
def slot_index(p: ExpertPlacement) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each logical expert's slots, per row, as read-only CSR (order [rows, P], start [rows, E], count [rows, E]):
    expert e of row m is in slots order[m, start[m, e]: start[m, e] + count[m, e]]."""
    out = _slot_lists(_table(p), p.logical_experts)
    for a in out:
        a.setflags(write=False)
    return out


__all__ = ["ExpertPlacement", "slot_index"]
