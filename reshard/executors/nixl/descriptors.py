"""NIXL descriptor lists of a link, and the memory regions a process registers. Pure numpy.

A descriptor is a row (address, bytes, device id) of an Nx3 uint64 array, as NIXL's prep_xfer_dlist and
register_memory take. `addresses` maps a memory's name (executors.copies kind and id) to its first byte's address.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from ...errors import ExecutionError
from ..copies import KIND_NAMES
from .schedule import Link

MEMORY_PREFIX = "SDHW"  # SRC, DST, SHADOW, WIRE as one letter in address books


def memory_name(kind: int, ident: int) -> str:
    """Memory (kind, id)'s name in an address book: the kind's letter of MEMORY_PREFIX, then the id."""
    return f"{MEMORY_PREFIX[kind]}{ident}"


def side_descriptors(link: Link, side: str, addresses: Mapping[str, int], itemsize: int, device: int,
                     owner: str) -> np.ndarray:
    """Nx3 descriptors of one side ("send" or "recv") of a link's pieces."""
    p = link.pieces
    kinds, ids, offs = p[f"{side}_kind"], p[f"{side}_id"], p[f"{side}_off"]
    keys = kinds * (1 << 40) + ids
    uniq, inverse = np.unique(keys, return_inverse=True)
    bases = np.empty(len(uniq), dtype=np.int64)
    for i, key in enumerate(uniq.tolist()):
        kind, ident = divmod(key, 1 << 40)
        name = memory_name(kind, ident)
        if name not in addresses:
            raise ExecutionError(f"{link}: {owner} published no address for its {KIND_NAMES[kind]} {ident}")
        bases[i] = addresses[name]
    out = np.empty((len(kinds), 3), dtype=np.uint64)
    out[:, 0] = (bases[inverse.reshape(-1)] + offs * itemsize).astype(np.uint64)
    out[:, 1] = (p["numel"] * itemsize).astype(np.uint64)
    out[:, 2] = device
    return out


def merged_regions(regions: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(address, nbytes) regions with overlapping ones merged (tensors viewing one buffer register once).
    Regions that only touch stay apart: on GPUs two allocations may be adjacent yet separate."""
    out: list[list[int]] = []
    for addr, n in sorted(r for r in regions if r[1] > 0):
        if out and addr < out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], addr + n - out[-1][0])
        else:
            out.append([addr, n])
    return [(a, n) for a, n in out]
