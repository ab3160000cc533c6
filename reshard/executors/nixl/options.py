"""The choices a NIXL refit makes, as one small immutable value that every process must share."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...errors import ExecutionError
from ..checksum import ALGORITHMS, algorithm

DIRECTIONS = ("auto", "read", "write")
PACKING = ("auto", "always", "never")

# Ops whose contiguous pieces are below PACK_BELOW are packed (one descriptor for the link's small pieces); runs
# contiguous on the sender whose receiver pieces average below LAND_BELOW are landed (one descriptor, then a local
# scatter). On CPU (cma) a descriptor is cheap; on GPUs a cuda_ipc descriptor's fixed cost is worth megabytes of
# NVLink time, while local copies run several times faster (row-size sweeps: BENCHMARKS.md, NIXL).
PACK_BELOW_DRAM, PACK_BELOW_VRAM = 16 << 10, 1 << 20
LAND_BELOW_DRAM, LAND_BELOW_VRAM = 32 << 10, 8 << 20


@dataclass(frozen=True)
class NixlOptions:
    """How a NixlExecutor moves bytes. Every process of a refit must pass equal options (checked at set-up).

    direction: "read" (receivers pull), "write" (senders push), or "auto": the one that spreads the initiated
        bytes best over the processes.
    staged: receive into staging memory, committed only once every process verified its refit (a failed refit
        leaves destinations unchanged; costs memory: executor.py). False writes in place.
    pack: "auto" packs a link's ops whose pieces are below `pack_below` bytes (None: a default per memory kind)
        when there are several, and lands sender-contiguous runs whose receiver pieces average below
        `land_below`; "always" packs every op, "never" neither packs nor lands.
    timeout: seconds a refit may take, from its start, before every waiting process gives up with an error.
    progress_delay_us: sleep of NIXL's progress thread between polls (0, NIXL's own, burns a core).
    poll_max_s: longest sleep between two polls of the refit loop while waiting.
    checksum: hash every link's bytes on both ends and compare them before anything is committed (True or
        "sha256", or "sum64": executors.checksum).
    """

    direction: str = "auto"
    staged: bool = True
    pack: str = "auto"
    pack_below: int | None = None
    land_below: int | None = None
    timeout: float = 120.0
    progress_delay_us: int = 1000
    poll_max_s: float = 0.0005
    checksum: bool | str = False

    def __post_init__(self) -> None:
        checks = (
            (self.direction in DIRECTIONS, f"direction={self.direction!r} must be one of {DIRECTIONS}"),
            (self.pack in PACKING, f"pack={self.pack!r} must be one of {PACKING}"),
            (self.pack_below is None or not self.pack_below < 0, f"pack_below={self.pack_below} must be >= 0 bytes"),
            (self.land_below is None or not self.land_below < 0, f"land_below={self.land_below} must be >= 0 bytes"),
            (self.timeout > 0, f"timeout={self.timeout} must be positive (seconds)"),
            (not self.progress_delay_us < 0, f"progress_delay_us={self.progress_delay_us} must be >= 0"),
            (self.poll_max_s >= 0, f"poll_max_s={self.poll_max_s} must be >= 0"),
            (isinstance(self.checksum, bool) or self.checksum in ALGORITHMS,
             f"checksum={self.checksum!r} must be False, True or one of {ALGORITHMS}"))
        problems = [message for ok, message in checks if not ok]
        if problems:
            raise ExecutionError("invalid NIXL options:\n  - " + "\n  - ".join(problems))

    def thresholds(self, device_memory: bool) -> tuple[int, int]:
        """(`pack_below`, `land_below`), each defaulting per memory kind: device (VRAM) or host."""
        return (self.pack_below if self.pack_below is not None else
                PACK_BELOW_VRAM if device_memory else PACK_BELOW_DRAM,
                self.land_below if self.land_below is not None else
                LAND_BELOW_VRAM if device_memory else LAND_BELOW_DRAM)

    def shared(self) -> dict[str, Any]:
        """The options that must be equal on every process (the rest are local tuning)."""
        out = {"direction": self.direction, "staged": self.staged, "pack": self.pack,
               "pack_below": self.pack_below, "land_below": self.land_below}
        if self.checksum:  # absent when off: books of processes that predate the option stay equal
            out["checksum"] = algorithm(self.checksum)
        return out
