"""What one process did in one refit: the one record every executor's `refit()` returns (a quantity an executor
does not have keeps its default).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np


@dataclass(frozen=True)
class RefitStats:
    """What one process did in one refit.

    Attributes:
        executor: the executor's name ("reference", "inprocess", "collective", "nixl", "shared", "fp8").
        process: this process's index in the binding (its group rank for "collective").
        version: the refit's version (the previous one + 1 unless the caller gave one).
        seconds: wall clock, call to return.
        phases: wall clock per step, in order (e.g. transfer, agree, commit).
        staged: the refit landed in staging memory, copied into the destination at commit.
        undo: the refit wrote in place with a backup to restore on failure (distributed).
        ops: plan ops this process ran or received.
        copies: block copies launched, where the executor counts them.
        bytes_sent: peer process -> bytes this process sent it.
        bytes_received: peer process -> bytes this process received from it.
        local_bytes: bytes copied within this process.
        staging_bytes: staging memory (shadows, packed buffers) this process holds.
        transfers: point-to-point transfers this process took part in (messages, links, peers).
        checksum: the algorithm every transfer's bytes were checked with ("" when none).
        digest: hex digest of every byte this process landed, in plan order, where the executor computes one.
        rounds: rounds of messages (distributed).
        lanes: communicators the rounds were spread over (distributed).
        bucket_bytes: the largest message (distributed).
        direct_bytes: bytes sent from or received into the tensors themselves (distributed).
        wire_bytes: wire buffer memory (distributed).
        direction: "read" or "write": who posts the transfers (nixl).
        packed_transfers: transfers packed into one buffer (nixl).
        descriptors: descriptors of the transfers this process posts (nixl).
        pause_s: seconds the engines did not generate, first pause call to last resume answer (adapters.trainer);
            0 where none was paused or this process does not drive the engines.
        in_flight: vLLM's ids of the requests the engines held while paused, where they report them; None: not
            known.
    """

    executor: str
    process: int
    version: int
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)
    staged: bool = False
    undo: bool = False
    ops: int = 0
    copies: int = 0
    bytes_sent: dict[int, int] = field(default_factory=dict)
    bytes_received: dict[int, int] = field(default_factory=dict)
    local_bytes: int = 0
    staging_bytes: int = 0
    transfers: int = 0
    checksum: str = ""
    digest: str = ""
    rounds: int = 0
    lanes: int = 0
    bucket_bytes: int = 0
    direct_bytes: int = 0
    wire_bytes: int = 0
    direction: str = ""
    packed_transfers: int = 0
    descriptors: int = 0
    pause_s: float = 0.0
    in_flight: tuple[str, ...] | None = None


def phase_times(start: float, marks: list[tuple[str, float]]) -> tuple[float, dict[str, float]]:
    """(seconds since `start` to the last mark, seconds per phase) from (phase, time at its end) marks."""
    times = [start] + [t for _, t in marks]
    return times[-1] - start, {name: times[i + 1] - times[i] for i, (name, _) in enumerate(marks)}


def ops_landing(plan: Any, dst_ranks: Iterable[int]) -> int:
    """The plan's ops whose destination is one of `dst_ranks`."""
    return int(np.isin(plan.ops["dst_rank"], list(dst_ranks)).sum())


__all__ = ["RefitStats", "ops_landing", "phase_times"]
