"""The choices a NIXL refit makes, as one small immutable value that every process must share."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ...errors import ExecutionError
from ..checksum import ALGORITHMS, algorithm

DIRECTIONS = ("auto", "read", "write")
PACKING = ("auto", "always", "never")

# Ops whose contiguous pieces are smaller than this are packed (gathered into one buffer on the sender, one
# descriptor, scattered on the receiver) instead of moved one descriptor per piece. On CPU (cma) a descriptor
# is cheap and packing pays only for small rows; on GPUs every cuda_ipc descriptor is a copy launch whose fixed
# cost is worth a large piece of NVLink time, while packing costs two device copies at several times NVLink's
# bandwidth (the row-size sweeps: BENCHMARKS.md, NIXL).
PACK_BELOW_DRAM = 16 << 10
PACK_BELOW_VRAM = 1 << 20
# A run contiguous on the sender whose receiver pieces average below this is landed (one descriptor into the
# receive buffer, then one local scatter): it saves a descriptor per piece for one copy, not two, so it pays
# up to larger pieces than packing: on GPUs a cuda_ipc descriptor's fixed cost is worth megabytes of NVLink
# time, while the local scatter copies far faster than NVLink (BENCHMARKS.md, NIXL: landing).
LAND_BELOW_DRAM = 32 << 10
LAND_BELOW_VRAM = 8 << 20


@dataclass(frozen=True)
class NixlOptions:
    """How a NixlExecutor moves bytes. Every process of a refit must pass equal options (checked at set-up).

    direction: "read" (each receiver pulls from registered source memory), "write" (each sender pushes), or
        "auto": the one that spreads the initiated bytes best over the processes (on CPU the initiator's
        thread does the copy).
    staged: receive into staging memory and copy into the destination tensors only after every process has
        verified its whole refit, so a failed refit leaves destinations unchanged (costs memory: see
        executor.py). False writes in place: faster and no extra memory, but a failed refit leaves
        destinations partly written.
    pack: "auto" packs the ops of a link whose contiguous pieces are below `pack_below` bytes (None: a default
        per memory kind) when there are several such pieces, and lands runs contiguous on the sender whose
        receiver pieces average below `land_below` bytes; "always" packs every op, "never" neither packs nor
        lands.
    timeout: seconds a refit may take, from its start, before every waiting process gives up with an error.
    progress_delay_us: sleep of NIXL's progress thread between polls (NIXL's Python wrapper spins it at 0,
        which burns a whole core; 0 keeps that behaviour).
    poll_max_s: longest sleep between two polls of the refit loop while waiting.
    checksum: hash every link's bytes on both ends and compare them before anything is committed (True or
        "sha256", or "sum64": executors.checksum); a mismatch fails the refit on every process.
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
        problems = []
        if self.direction not in DIRECTIONS:
            problems.append(f"direction={self.direction!r} must be one of {DIRECTIONS}")
        if self.pack not in PACKING:
            problems.append(f"pack={self.pack!r} must be one of {PACKING}")
        if self.pack_below is not None and self.pack_below < 0:
            problems.append(f"pack_below={self.pack_below} must be >= 0 bytes")
        if self.land_below is not None and self.land_below < 0:
            problems.append(f"land_below={self.land_below} must be >= 0 bytes")
        if not self.timeout > 0:
            problems.append(f"timeout={self.timeout} must be positive (seconds)")
        if self.progress_delay_us < 0:
            problems.append(f"progress_delay_us={self.progress_delay_us} must be >= 0")
        if not self.poll_max_s >= 0:
            problems.append(f"poll_max_s={self.poll_max_s} must be >= 0")
        if not (isinstance(self.checksum, bool) or self.checksum in ALGORITHMS):
            problems.append(f"checksum={self.checksum!r} must be False, True or one of {ALGORITHMS}")
        if problems:
            raise ExecutionError("invalid NIXL options:\n  - " + "\n  - ".join(problems))

    def pack_threshold(self, device_memory: bool) -> int:
        """`pack_below`, or its default for device (VRAM) or host memory."""
        if self.pack_below is not None:
            return self.pack_below
        return PACK_BELOW_VRAM if device_memory else PACK_BELOW_DRAM

    def land_threshold(self, device_memory: bool) -> int:
        """`land_below`, or its default for device (VRAM) or host memory."""
        if self.land_below is not None:
            return self.land_below
        return LAND_BELOW_VRAM if device_memory else LAND_BELOW_DRAM

    def to_dict(self) -> dict[str, Any]:
        """Every option by name (JSON-ready)."""
        return asdict(self)

    def shared(self) -> dict[str, Any]:
        """The options that must be equal on every process (the rest are local tuning)."""
        out = {"direction": self.direction, "staged": self.staged, "pack": self.pack,
               "pack_below": self.pack_below, "land_below": self.land_below}
        if self.checksum:  # absent when off: books of processes that predate the option stay equal
            out["checksum"] = algorithm(self.checksum)
        return out
