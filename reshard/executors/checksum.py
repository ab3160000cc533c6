"""End-to-end checksums of a refit (executors' `checksum=True`): what a receiver got is what its sender sent.

Per transfer (one stream: the bytes one process sends another in one refit, in a fixed order), both ends hash the
bytes; the sender's digest travels to the receiver, which compares it with what landed before anything is
committed: a mismatch fails the refit everywhere. Off by default (nothing computed or sent). `tensor_digest` is
SHA-256 of a tensor's raw bytes, as vLLM's /weight_checker computes per parameter.

Algorithms (True means "sha256"; every process must pick the same):
- "sha256": on the host (GPU bytes copied there: for debugging only on GPUs).
- "sum64": where the bytes are. Bytes x_i at stream positions i give the count and three sums mod 2^64: sum x_i,
  sum x_i (i + 1), and sum x_i T[i mod 2^23] with T[j] = ((j 1103515245 + 12345) mod 2^31) >> 8. Any one
  corrupted byte, or two swapped, change the second sum; how a stream is cut into blocks does not matter. Not
  cryptographic: it catches corruption in flight, not a forger. On GPUs with Triton a fused kernel per block
  (kernels.sum64), `Sum64Program` (one CUDA graph over fixed blocks) and kernels.copy_sum64 give the same digests.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Any, Callable, Hashable, Mapping

import torch

from ..errors import ArgumentError
from .graphs import Replay, single_cuda_device

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
        if option == "sum64":  # the tables (about a second to make) at set-up, not within a refit's deadline
            _tables(torch.device("cpu"))
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


def _pack(count: int, sums: "list[int]") -> bytes:
    """A "sum64" digest: count and three sums, 32 bytes little-endian."""
    return struct.pack("<4Q", count & _MASK64, *(v & _MASK64 for v in sums))


class _Sum64:
    """The running sums of one "sum64" stream, kept on the bytes' device (no host sync until the digest).

    Cut at multiples of PERIOD (2^23), a byte times j + 1 or T[j] stays below 2^31: products in int32, sums int64."""

    def __init__(self) -> None:
        self.count = 0
        self.sums: list[torch.Tensor] = []  # s1, s2, s3: int64 scalars on the device of the first block

    def _start(self, device: torch.device) -> None:
        if not self.sums:
            self.sums = [torch.zeros((), dtype=torch.int64, device=device) for _ in range(3)]

    def update(self, flat: torch.Tensor) -> None:
        device = flat.device
        self._start(device)
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
        self._start(t.device)
        for acc, v in zip(self.sums, part):
            acc.add_(v)
        self.count += k.count

    def digest(self) -> bytes:
        return _pack(self.count, [int(v.item()) for v in self.sums] if self.sums else [0, 0, 0])


def use_kernel(blocks: "list[torch.Tensor]") -> bool:
    """Whether the fused sum64 kernel takes these blocks: all on one GPU, Triton there, each block rows of
    contiguous bytes."""
    if not blocks or single_cuda_device(blocks) is None:
        return False
    try:
        from ..kernels.sum64 import byte_rows
    except ImportError:
        return False
    return all(byte_rows(b) is not None for b in blocks)


class Sum64Program:
    """The "sum64" digest of a fixed list of blocks (one stream from position 0), recomputed at each call as one
    CUDA graph replay from the second call (executors.graphs)."""

    def __init__(self, blocks: "list[torch.Tensor]") -> None:
        from ..kernels.sum64 import Sum64Launches

        self._k = Sum64Launches(blocks)
        self._run = Replay(self._k.launch, single_cuda_device(blocks))

    def hexdigest(self) -> str:
        """The blocks' "sum64" digest now (count and three sums, 32 bytes little-endian), as hex."""
        self._run()
        return _pack(self._k.count, [int(v) for v in self._k.sums().tolist()]).hex()


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
    """One running checksum per stream key (e.g. ("to", peer)) for one refit, by `algorithm` ("sha256", "sum64")."""

    def __init__(self, algorithm: str = "sha256") -> None:
        if algorithm not in ALGORITHMS:
            raise ArgumentError("checksum", algorithm, f"must be one of {ALGORITHMS}")
        self.algorithm = algorithm
        self._h: dict[Hashable, Any] = {}

    def update(self, key: Hashable, t: torch.Tensor) -> None:
        """Feed tensor `t`'s bytes into stream `key` (started on first use)."""
        h = self._h[key] = self._h.get(key) or self._new()
        if not t.numel():
            return
        if self.algorithm == "sha256":
            h.update(raw_bytes(t))
        elif use_kernel([t]):
            h.update_kernel(t.detach())
        else:
            h.update(t.detach().contiguous().view(-1).view(torch.uint8))

    def digest(self, key: Hashable) -> bytes:
        """Stream `key`'s digest so far (an empty stream's if it never got bytes)."""
        return (self._h.get(key) or self._new()).digest()

    def _new(self) -> Any:
        return hashlib.sha256() if self.algorithm == "sha256" else _Sum64()

    def hexdigest(self, key: Hashable) -> str:
        """`digest` as hex."""
        return self.digest(key).hex()


def blocks_digest(algorithm: str, blocks: "list[torch.Tensor]") -> bytes:
    """The `algorithm` digest of the blocks' bytes as one stream, in order."""
    sums = Streams(algorithm)
    for b in blocks:
        sums.update(0, b)
    return sums.digest(0)


def fixed_digest(algorithm: str, blocks: "list[torch.Tensor]") -> "Callable[[], str]":
    """A function returning the hex `algorithm` digest of these blocks' bytes now, as one stream in order ("sum64"
    on one GPU with the kernel: one `Sum64Program`)."""
    if algorithm == "sum64" and use_kernel(blocks):
        return Sum64Program(blocks).hexdigest
    return lambda: blocks_digest(algorithm, blocks).hex()


def mismatch(what: str, sent: str, got: str) -> str:
    """The error message for a block whose checksum on arrival is not the one its sender sent."""
    return (f"checksum mismatch: {what} arrived with checksum {got[:16]}, the sender sent {sent[:16]} (bytes "
            f"were corrupted in flight)")


__all__ = ["ALGORITHMS", "DIGEST_BYTES", "Streams", "Sum64Program", "algorithm", "blocks_digest", "fixed_digest",
           "mismatch", "raw_bytes", "tensor_digest", "tensor_digests", "use_kernel"]
