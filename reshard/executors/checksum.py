"""End-to-end checksums of a refit (executors' `checksum=True`): what a receiver got is what its sender sent.

Per transfer: the bytes one process sends another in one refit (one stream: a pair's messages in round order
for the torch.distributed executor, a link's descriptor pieces in order for NIXL, a pair's ops in plan order for
shared memory) are hashed with SHA-256 on both ends, the sender's digest travels to the receiver (a message, a
store key), and the receiver compares it with the digest of what landed, before anything is committed. A
mismatch fails the refit on every process like any other fault, so a staged refit leaves the destinations as
they were. Off (the default), the executors compute nothing and send nothing more.

Per tensor: `tensor_digest` is SHA-256 of a tensor's raw bytes, the digest vLLM's /weight_checker computes for
each parameter (`hashlib.sha256(w.cpu().contiguous().view(-1).view(torch.uint8).numpy())`), so a destination
tensor a refit wrote in place can be cross-checked against the engine's own checksums.

Two algorithms (the option's value; True means "sha256"; every process of a refit must pick the same one):
- "sha256": on the host. GPU bytes are copied to host memory to be hashed: about two hashing passes over the
  bytes per refit at one core's hashing speed: fine for CPU refits, for debugging only on GPUs (BENCHMARKS.md,
  Checksums).
- "sum64": computed where the bytes are, by torch ops (on the GPU for GPU tensors, a few passes over the
  bytes): a stream's bytes x_i at stream positions i give the count and three sums mod 2^64 -- sum x_i,
  sum x_i (i + 1), and sum x_i T[i mod 2^23] with pseudo-random weights T[j] = ((j 1103515245 + 12345) mod
  2^31) >> 8. Any one corrupted byte changes the second sum (its change d (i + 1) is not 0 mod 2^64 for
  0 < |d| < 256 and i < 2^55), as do two swapped bytes; positions are the stream's, so how a stream is cut into
  blocks does not matter. Not a cryptographic hash: it catches corruption in flight, not a forger.
  On GPUs (with Triton) the sums are one fused kernel per block (reshard.kernels.sum64: each byte read once), and
  `Sum64Program` digests a fixed list of blocks (an executor's stream, bound once) as one CUDA graph replay; both
  give the digests of the torch ops here, bit for bit. In one process, the inprocess executor's checksum="sum64"
  (the inprocess transport's option) digests the bytes in the kernel that copies them (kernels.copy_sum64: the
  weights' period folds the stream, so no weight is computed per byte), the same digest again.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Any, Hashable, Mapping

import torch

from ..errors import ArgumentError
from .reference import block  # noqa: F401 - a block of a flat view, for the executors that hash blocks

DIGEST_BYTES = 32
ALGORITHMS = ("sha256", "sum64")
_MASK64 = (1 << 64) - 1
PERIOD = 1 << 23  # "sum64" weights repeat with this period (bytes); see _Sum64
_TABLES: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def algorithm(option: bool | str | None) -> str | None:
    """The executors' `checksum` option as an algorithm name; None when off (False / None). True is "sha256"."""
    if option is None or option is False:
        return None
    if option is True:
        return "sha256"
    if isinstance(option, str) and option in ALGORITHMS:
        if option == "sum64":  # executors resolve the option at set-up: the tables are made there, not in a refit's
            _tables(torch.device("cpu"))  # deadline (2^23 entries each: about a second on a loaded 2-core machine)
        return option
    raise ArgumentError("checksum", option, f"must be False, True or one of {ALGORITHMS}")


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a tensor (a contiguous host copy if it is not one already), as a buffer hashlib reads."""
    flat = t.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous().view(-1).view(torch.uint8)
    return memoryview(flat.numpy())


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's raw bytes (hex): vLLM's /weight_checker checksum of a parameter."""
    return hashlib.sha256(raw_bytes(t)).hexdigest()


def tensor_digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """`tensor_digest` of every tensor (name -> hex digest)."""
    return {name: tensor_digest(t) for name, t in tensors.items()}


class _Sum64:
    """The running sums of one "sum64" stream, kept on the bytes' device (no host sync until the digest).

    The stream is cut at multiples of PERIOD (2^23): within a period, byte x at offset j (< 2^23) times j + 1 or
    times T[j] (< 2^23) stays below 2^31, so the products run in int32 and only the sums widen to int64."""

    def __init__(self) -> None:
        self.count = 0
        self.sums: list[torch.Tensor] = []  # s1, s2, s3: int64 scalars on the device of the first block

    def update(self, flat: torch.Tensor) -> None:
        device = flat.device
        if not self.sums:
            self.sums = [torch.zeros((), dtype=torch.int64, device=device) for _ in range(3)]
        ramp, weights = _tables(device)
        s1, s2, s3 = self.sums
        pos, done, n = self.count, 0, flat.numel()
        while done < n:
            j = pos % PERIOD
            k = min(n - done, PERIOD - j)
            piece = flat.narrow(0, done, k)
            part = piece.sum(dtype=torch.int64)
            s1.add_(part.to(s1.device))
            s2.add_((part * (pos - j) + (piece * ramp.narrow(0, j, k)).sum(dtype=torch.int64)).to(s2.device))
            s3.add_((piece * weights.narrow(0, j, k)).sum(dtype=torch.int64).to(s3.device))
            pos, done = pos + k, done + k
        self.count = pos

    def update_kernel(self, t: torch.Tensor) -> None:
        """The same update by the fused kernel, for a block of rows of contiguous bytes (kernels.sum64)."""
        from ..kernels.sum64 import Sum64Launches

        k = Sum64Launches([t], self.count)
        k.launch()
        part = k.sums()
        if not self.sums:
            self.sums = [torch.zeros((), dtype=torch.int64, device=t.device) for _ in range(3)]
        for acc, v in zip(self.sums, part):
            acc.add_(v)
        self.count += k.count

    def digest(self) -> bytes:
        sums = [int(v.item()) & _MASK64 for v in self.sums] if self.sums else [0, 0, 0]
        return struct.pack("<4Q", self.count & _MASK64, *sums)


def use_kernel(blocks: "list[torch.Tensor]", force: bool = False) -> bool:
    """Whether the fused sum64 kernel takes these blocks: all on one GPU (or `force`: any device, for Triton's
    interpreter), Triton importable, every block rows of contiguous bytes."""
    from .graphs import single_cuda_device

    if not blocks or (not force and single_cuda_device(blocks) is None):
        return False
    try:
        from ..kernels.sum64 import byte_rows
    except ImportError:
        return False
    return all(byte_rows(b) is not None for b in blocks)


class Sum64Program:
    """The "sum64" digest of a fixed list of blocks (one stream's, in order, from position 0), recomputed at each
    call: the kernel's launches, replayed as one CUDA graph from the second call (executors.graphs)."""

    def __init__(self, blocks: "list[torch.Tensor]") -> None:
        from ..kernels.sum64 import Sum64Launches
        from .graphs import Replay, single_cuda_device

        self._k = Sum64Launches(blocks)
        self._run = Replay(self._k.launch, single_cuda_device(blocks))

    def digest(self) -> bytes:
        """The blocks' "sum64" digest now (count and three sums, 32 bytes little-endian)."""
        self._run()
        sums = [int(v) & _MASK64 for v in self._k.sums().tolist()]
        return struct.pack("<4Q", self._k.count & _MASK64, *sums)

    def hexdigest(self) -> str:
        """`digest` as hex."""
        return self.digest().hex()


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """ramp[j] = j + 1 and the pseudo-random weights T[j] = ((j * 1103515245 + 12345) mod 2^31) >> 8, int32,
    j < PERIOD, made once per device."""
    if "cpu" not in _TABLES:
        j = torch.arange(PERIOD, dtype=torch.int64)
        weights = torch.bitwise_right_shift(torch.bitwise_and(j * 1_103_515_245 + 12_345, (1 << 31) - 1), 8)
        _TABLES["cpu"] = ((j + 1).to(torch.int32), weights.to(torch.int32))
    key = str(device)
    if key not in _TABLES:
        _TABLES[key] = tuple(t.to(device) for t in _TABLES["cpu"])  # type: ignore[assignment]
    return _TABLES[key]


class Streams:
    """One running checksum per stream key (e.g. ("to", peer) / ("from", peer)), for one refit; `algorithm` is
    "sha256" (host) or "sum64" (on the bytes' device)."""

    def __init__(self, algorithm: str = "sha256") -> None:
        if algorithm not in ALGORITHMS:
            raise ArgumentError("checksum", algorithm, f"must be one of {ALGORITHMS}")
        self.algorithm = algorithm
        self._h: dict[Hashable, Any] = {}

    def update(self, key: Hashable, t: torch.Tensor) -> None:
        """Feed tensor `t`'s bytes into stream `key` (started on first use)."""
        h = self._h.get(key)
        if h is None:
            h = self._h[key] = hashlib.sha256() if self.algorithm == "sha256" else _Sum64()
        if not t.numel():
            return
        if self.algorithm == "sha256":
            h.update(raw_bytes(t))
        elif t.device.type == "cuda" and use_kernel([t]):
            h.update_kernel(t.detach())
        else:
            h.update(t.detach().contiguous().view(-1).view(torch.uint8))

    def digest(self, key: Hashable) -> bytes:
        """Stream `key`'s digest so far (an empty stream's if it never got bytes)."""
        h = self._h.get(key)
        if h is None:
            h = hashlib.sha256() if self.algorithm == "sha256" else _Sum64()
        return h.digest()

    def hexdigest(self, key: Hashable) -> str:
        """`digest` as hex."""
        return self.digest(key).hex()


def blocks_digest(algorithm: str, blocks: "list[torch.Tensor]") -> bytes:
    """The `algorithm` digest of the blocks' bytes as one stream, in order."""
    sums = Streams(algorithm)
    for b in blocks:
        sums.update(0, b)
    return sums.digest(0)


def mismatch(what: str, sent: str, got: str) -> str:
    """The error message for a block whose checksum on arrival is not the one its sender sent."""
    return (f"checksum mismatch: {what} arrived with checksum {got[:16]}, the sender sent {sent[:16]} (bytes "
            f"were corrupted in flight)")


__all__ = ["ALGORITHMS", "DIGEST_BYTES", "Streams", "Sum64Program", "algorithm", "block", "blocks_digest", "mismatch", "raw_bytes",
           "tensor_digest", "tensor_digests", "use_kernel"]
