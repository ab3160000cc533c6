"""Reading a saved plan's bytes as untrusted input: a JSON file, or an .npz (a zip of .npy arrays and a JSON
header), opened without pickle, each member's size and dtype checked from its .npy header before it is read,
so a hostile file can neither run code nor make the reader allocate more than the limits allow.
What the content means is checked afterwards (planner.verify)."""
from __future__ import annotations

import os
import stat
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import PlanFileError
from ..limits import MAX_PLAN_ELEMENTS, MAX_PLAN_HEADER_BYTES
from ..untrusted import parse_json, read_bytes
from .program_check import bad

MAX_MEMBERS = 64


def read_saved(path: "str | os.PathLike[str]") -> tuple[Any, Any]:
    """(header, arrays) of a saved plan: arrays None for a JSON plan (they are in the header's "arrays")."""
    if not isinstance(path, (str, os.PathLike)) or isinstance(path, bytes):
        raise bad("path", path, "must be a path (str or pathlib.Path)")
    path = Path(path)
    if path.suffix.lower() == ".json":  # as Plan.save writes it
        return parse_json(read_bytes(path, MAX_PLAN_HEADER_BYTES, bad, "path"), bad, "path", str(path)), None
    try:
        info = os.stat(path)
    except OSError as e:
        raise bad("path", str(path), f"cannot be read ({e.strerror or e})") from None
    if not stat.S_ISREG(info.st_mode):
        raise bad("path", str(path), "is not a regular file")
    try:
        with zipfile.ZipFile(path) as z:
            members = z.infolist()
            if len(members) > MAX_MEMBERS:
                raise bad("path", str(path), f"holds {len(members)} members; a plan has at most {MAX_MEMBERS}")
            arrays: dict[str, np.ndarray] = {}
            header = None
            for m in members:
                name = m.filename[:-4] if m.filename.endswith(".npy") else None
                if name is None or not (name == "header" or name.startswith("a:")):
                    raise bad("path", m.filename, "is not a member of a saved plan")
                a = _read_member(z, m, name)
                if name == "header":
                    header = a
                else:
                    arrays[name[2:]] = a
    except PlanFileError:
        raise
    except Exception as e:  # noqa: BLE001 - zip, zlib and numpy's .npy parsing raise many types on bad bytes

        raise bad("path", str(path), f"is not a readable saved plan (.npz): {type(e).__name__}: {e}") from None
    if header is None:
        raise bad("header", None, "is missing from the .npz")
    if header.dtype != np.uint8 or header.ndim != 1:
        raise bad("header", str(header.dtype), "must be the UTF-8 bytes of a JSON object")
    return parse_json(header.tobytes(), bad, "header", str(path)), arrays


def _read_member(z: zipfile.ZipFile, m: zipfile.ZipInfo, name: str) -> np.ndarray:
    limit = MAX_PLAN_HEADER_BYTES if name == "header" else MAX_PLAN_ELEMENTS * 8
    if m.file_size > limit + 4096:
        raise bad(name, m.file_size, f"is larger than the limit of {limit:,} bytes")
    with z.open(m) as f:
        version = np.lib.format.read_magic(f)
        if version not in ((1, 0), (2, 0)):
            raise bad(name, version, "is not a .npy array of a known version")
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(f, max_header_size=10000)
        count = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
        if dtype.hasobject or dtype.kind not in "iub" or count * dtype.itemsize > limit:
            raise bad(name, f"{dtype} {shape}", "must be a plain integer array within the size limit")
    with z.open(m) as f:
        return np.lib.format.read_array(f, allow_pickle=False, max_header_size=10000)


__all__ = ["read_saved"]
