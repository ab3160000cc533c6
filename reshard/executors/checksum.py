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

Checksums run on the host: GPU bytes are copied to host memory to be hashed (slow; meant for CPU refits and
for debugging GPU ones).
"""
from __future__ import annotations

import hashlib
from typing import Any, Hashable, Mapping

import torch

DIGEST_BYTES = 32


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


def block(flat: torch.Tensor, offset: int, rows: int, cols: int, stride: int) -> torch.Tensor:
    """The rows x cols block at `offset` of a flat view, rows `stride` apart."""
    if rows == 1:
        return flat.narrow(0, offset, cols)
    return flat.as_strided((rows, cols), (stride, 1), flat.storage_offset() + offset)


class Streams:
    """One running SHA-256 per stream key (e.g. ("to", peer) / ("from", peer)), for one refit."""

    def __init__(self) -> None:
        self._h: dict[Hashable, Any] = {}

    def update(self, key: Hashable, t: torch.Tensor) -> None:
        h = self._h.get(key)
        if h is None:
            h = self._h[key] = hashlib.sha256()
        if t.numel():
            h.update(raw_bytes(t))

    def digest(self, key: Hashable) -> bytes:
        h = self._h.get(key)
        return (h or hashlib.sha256()).digest()

    def hexdigest(self, key: Hashable) -> str:
        return self.digest(key).hex()


def mismatch(what: str, sent: str, got: str) -> str:
    return (f"checksum mismatch: {what} arrived with SHA-256 {got[:16]}, the sender sent {sent[:16]} (bytes were "
            f"corrupted in flight)")


__all__ = ["DIGEST_BYTES", "Streams", "block", "mismatch", "raw_bytes", "tensor_digest", "tensor_digests"]
