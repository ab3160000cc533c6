"""A megatron-core `torch_dist` checkpoint as a lazily read, validated set of global tensors.

The format: `metadata.json` (the backend), `.metadata` (torch.distributed.checkpoint's Metadata: each tensor's
global shape, dtype and chunks, each chunk's file, byte offset and length) and `__R_K.distcp` files of
`torch.save` records. Tensors are saved at global coordinates (layers, then experts, stacked on leading axes), so
the checkpoint is a TP=1, PP=1, EP=1 model.

Trust: `.metadata` is read by an unpickler that builds only torch.distributed.checkpoint's metadata classes,
torch.Size and dtypes; every chunk's bounds, coverage, file and byte range are validated before any tensor is
read, and records are decoded with `torch.load(weights_only=True)` and checked. Pickled objects (`common.pt`,
byte records) are never read. `read(key, offsets, lengths)` reads only the chunks a box intersects, by byte
range, counting `bytes_read`.
"""
from __future__ import annotations

import io
import math
import os
import pickle
import sys
import threading
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np
import torch

from ...errors import InputError
from ...untrusted import read_bytes, read_json

MAX_METADATA_BYTES = 1 << 30  # a trillion-parameter checkpoint's .metadata is a few hundred MiB
MAX_GRID_CELLS = 1 << 24  # coverage check of one tensor's chunk grid
_DTYPES = {torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8,
           torch.int8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2}
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "TensorProperties",
                                              "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
}


class CheckpointError(InputError):
    """A checkpoint directory reshard cannot read: `problems` lists every problem found."""

    def __init__(self, path: str, problems: list[str] | tuple[str, ...], fix: str = "") -> None:
        self.problems = tuple(problems)
        shown = "\n  - ".join(self.problems[:30])
        more = f"\n  ... and {len(self.problems) - 30} more" if len(self.problems) > 30 else ""
        super().__init__("checkpoint", path, f"is not a readable megatron-core torch_dist checkpoint:\n  - "
                         f"{shown}{more}", fix)


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only torch.distributed.checkpoint's metadata classes, torch.Size and dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a torch.distributed.checkpoint metadata class")


@dataclass(frozen=True)
class SavedChunk:
    """One chunk of a saved tensor: its box in the global tensor and where its torch.save record lies."""
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # relative to the checkpoint directory
    offset: int  # byte offset of the record in the file
    length: int  # bytes of the record

    def intersect(self, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[tuple[int, ...], ...] | None:
        """The overlap with a box as (start, stop) per dimension in global coordinates, or None."""
        out = []
        for o, n, co, cn in zip(offsets, lengths, self.offsets, self.sizes):
            lo, hi = max(o, co), min(o + n, co + cn)
            if lo >= hi:
                return None
            out.append((lo, hi))
        return tuple(out)


@dataclass(frozen=True)
class SavedTensor:
    """One tensor of a checkpoint as its metadata describes it: its global shape and dtype, and its saved chunks."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[SavedChunk, ...]


@dataclass(eq=False)
class Checkpoint:
    """The validated tensors of a torch_dist checkpoint; `read` reads boxes of them lazily, counting bytes."""
    path: Path
    tensors: Mapping[str, SavedTensor]
    bytes_read: int = 0  # bytes read from the shard files: tensor data, and each opened record's directory
    chunks_read: int = 0  # records opened
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _starts: dict[SavedChunk, int | None] = field(default_factory=dict, repr=False)
    _fds: dict[str, int] = field(default_factory=dict, repr=False)
    _by_first: dict[str, dict[int, list[SavedChunk]]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.tensors = MappingProxyType(dict(self.tensors))

    def close(self) -> None:
        """Close the shard files opened so far (reading again reopens them)."""
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __del__(self) -> None:
        self.close()

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data in the checkpoint."""
        return sum(math.prod(t.shape) * t.dtype.itemsize for t in self.tensors.values())

    @property
    def record_bytes(self) -> int:
        """Bytes of the shard files' tensor records (what reading every tensor reads)."""
        return sum(c.length for t in self.tensors.values() for c in t.chunks)

    def holds(self, key: str, index: tuple[int, ...]) -> bool:
        """Whether the slice at `index` of the leading (layer, expert) axes of `key` is saved whole."""
        saved = self.tensors[key]
        with self._lock:
            by_first = self._by_first.get(key)
            if by_first is None:
                by_first = self._by_first[key] = {}
                for c in saved.chunks:
                    by_first.setdefault(c.offsets[0] if c.offsets else 0, []).append(c)
        want = math.prod(saved.shape[len(index):])
        box = (tuple(index) + (0,) * (len(saved.shape) - len(index)), (1,) * len(index) + saved.shape[len(index):])
        got = 0
        for c in by_first.get(index[0], ()) if index else saved.chunks:
            inter = c.intersect(*box)
            got += math.prod(hi - lo for lo, hi in inter) if inter is not None else 0
        return got == want

    def read(self, key: str, offsets: tuple[int, ...] | None = None,
             lengths: tuple[int, ...] | None = None) -> torch.Tensor:
        """The box (offsets, lengths) of tensor `key` (default: whole), read from the chunks that intersect it only."""
        saved = self.tensors.get(key)
        if saved is None:
            raise CheckpointError(str(self.path), [f"tensor {key!r} is not in the checkpoint"])
        offsets = tuple(offsets) if offsets is not None else (0,) * len(saved.shape)
        lengths = tuple(lengths) if lengths is not None else saved.shape
        if len(offsets) != len(saved.shape) or len(lengths) != len(saved.shape) or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, saved.shape)):
            raise CheckpointError(str(self.path), [f"box {offsets} + {lengths} is outside {key} {saved.shape}"])
        out = torch.empty(lengths, dtype=saved.dtype)
        boxes = [(chunk, box) for chunk in saved.chunks if (box := chunk.intersect(offsets, lengths)) is not None]
        if sum(math.prod(hi - lo for lo, hi in box) for _, box in boxes) != math.prod(lengths):
            raise CheckpointError(str(self.path), [f"{key}: the box {offsets} + {lengths} is not saved whole (a "
                                                   "layer or expert the checkpoint does not hold)"])
        for chunk, box in boxes:
            out[tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(box, offsets))] = self._read_box(saved, chunk, box)
        return out

    def _read_box(self, saved: SavedTensor, chunk: SavedChunk, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """The part `box` (global (start, stop) per dimension) of one chunk, by byte span where the record is plain."""
        local = [(lo - c, hi - c) for (lo, hi), c in zip(box, chunk.offsets)]
        start = self._data_start(saved, chunk)
        if start is None:
            return self._chunk(saved, chunk)[tuple(slice(lo, hi) for lo, hi in local)]
        strides = [math.prod(chunk.sizes[d + 1:]) for d in range(len(chunk.sizes))]
        first = sum(lo * s for (lo, _), s in zip(local, strides))
        last = sum((hi - 1) * s for (_, hi), s in zip(local, strides)) + 1
        flat = torch.empty(last - first, dtype=saved.dtype)
        self._read_into(saved, chunk, chunk.offset + start + first * saved.dtype.itemsize, flat)
        return flat.as_strided([hi - lo for lo, hi in local], strides)

    def _read_into(self, saved: SavedTensor, chunk: SavedChunk, offset: int, out: Any) -> Any:
        """Read the bytes at `offset` straight into `out` (a tensor or bytearray: one copy, no intermediate buffer)."""
        if isinstance(out, bytearray):
            view = memoryview(out)
        else:
            view = memoryview(out.view(torch.uint8).numpy()).cast("B") if out.numel() else memoryview(b"")
        with self._lock:
            fd = self._fds.get(chunk.file)
            if fd is None:
                fd = self._fds[chunk.file] = os.open(self.path / chunk.file, os.O_RDONLY)
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise CheckpointError(str(self.path), [f"{saved.key}: {chunk.file} ends before byte "
                                                       f"{offset + len(view)} (the file was truncated after the "
                                                       "checkpoint was opened)"])
            done += n
        with self._lock:
            self.bytes_read += done
        return out

    def _data_start(self, saved: SavedTensor, chunk: SavedChunk) -> int | None:
        """Where the tensor's bytes start in the chunk's record when it is the plain form; None otherwise. Cached."""
        with self._lock:
            if chunk in self._starts:
                return self._starts[chunk]
        start = _plain_data_start(_Window(self, saved, chunk), chunk.sizes, saved.dtype)
        with self._lock:
            self._starts[chunk] = start
            self.chunks_read += 1
        return start

    def _chunk(self, saved: SavedTensor, chunk: SavedChunk) -> torch.Tensor:
        """The whole record decoded by torch (weights_only) and checked against the metadata."""
        record = self._read_into(saved, chunk, chunk.offset, bytearray(chunk.length))
        where = f"{chunk.file} at byte {chunk.offset}"
        try:
            data = torch.load(io.BytesIO(record), weights_only=True, map_location="cpu")
        except Exception as e:  # a torn or forged record: torch says why
            raise CheckpointError(str(self.path), [f"{saved.key}: the record in {where} is not a tensor "
                                                   f"torch can load ({type(e).__name__}: {e})"]) from None
        if not isinstance(data, torch.Tensor) or tuple(data.shape) != chunk.sizes or data.dtype != saved.dtype:
            got = f"{tuple(data.shape)} {data.dtype}" if isinstance(data, torch.Tensor) else type(data).__name__
            raise CheckpointError(str(self.path), [f"{saved.key}: the record in {where} holds {got}, the metadata "
                                                   f"says {chunk.sizes} {saved.dtype}"])
        return data


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Open a torch_dist checkpoint directory, its metadata validated (CheckpointError lists every problem)."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(str(root), ["is not a directory"])

    def error(field_: str, value: Any, rule: str) -> CheckpointError:
        return CheckpointError(str(root), [f"{field_} {rule}"])

    config = read_json(root / "metadata.json", 1 << 16, error, "metadata.json")
    if not isinstance(config, dict) or config.get("sharded_backend") != "torch_dist":
        backend = config.get("sharded_backend") if isinstance(config, dict) else config
        raise CheckpointError(str(root), [f"metadata.json names backend {backend!r}, not 'torch_dist'"],
                              fix="only megatron-core's torch_dist format is read (zarr and fsdp_dtensor are not)")
    raw = read_bytes(root / ".metadata", MAX_METADATA_BYTES, error, ".metadata")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as e:
        raise CheckpointError(str(root), [f".metadata cannot be read as torch.distributed.checkpoint metadata "
                                          f"({type(e).__name__}: {e})"]) from None
    tensors, problems = _tensors(root, metadata)
    if problems:
        raise CheckpointError(str(root), problems)
    return Checkpoint(root, tensors)


def _tensors(root: Path, metadata: Any) -> tuple[dict[str, SavedTensor], list[str]]:
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict) \
            or not isinstance(metadata.storage_data, dict):
        return {}, [".metadata does not hold torch.distributed.checkpoint Metadata with storage data"]
    sizes: dict[str, int] = {}
    problems: list[str] = []
    tensors = {}
    for key, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue  # byte records (pickled objects): never read
        if not isinstance(key, str):
            problems.append(f"tensor key {key!r} is not a string")
            continue
        dtype, shape = meta.properties.dtype, tuple(meta.size)
        if dtype not in _DTYPES:
            problems.append(f"{key}: dtype {dtype} is not a tensor dtype reshard reads")
            continue
        if not all(isinstance(s, int) and 0 <= s < 1 << 40 for s in shape):
            problems.append(f"{key}: shape {shape} is not a list of sizes")
            continue
        got = [_saved_chunk(root, metadata, key, c, shape, dtype, sizes) for c in meta.chunks]
        problems += [f"{key}: chunk {i} {c}" for i, c in enumerate(got) if isinstance(c, str)]
        chunks = [c for c in got if not isinstance(c, str)]
        if len(chunks) == len(meta.chunks):
            problems += _coverage_problems(key, shape, chunks)
        tensors[key] = SavedTensor(key, shape, dtype, tuple(chunks))
    return tensors, problems


def _saved_chunk(root: Path, metadata: Any, key: str, c: Any, shape: tuple[int, ...], dtype: torch.dtype,
                 sizes: dict[str, int]) -> SavedChunk | str:
    """The chunk `c` of tensor `key`, validated, or what is wrong with it (`sizes`: the shard files' sizes so far)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    offsets, csizes = tuple(c.offsets), tuple(c.sizes)
    if len(offsets) != len(shape) or len(csizes) != len(shape) or any(
            not isinstance(o, int) or not isinstance(n, int) or o < 0 or n <= 0 or o + n > s
            for o, n, s in zip(offsets, csizes, shape)):
        return f"at {offsets} of {csizes} is outside the tensor's {shape}"
    info = metadata.storage_data.get(MetadataIndex(key, c.offsets))
    if info is None:
        return f"at {offsets} has no storage entry (a missing shard)"
    file, offset, length = info.relative_path, info.offset, info.length
    if not isinstance(file, str) or not file or "/" in file or "\\" in file or file.startswith("."):
        return f"is stored in {file!r}, not a file of the checkpoint directory"
    if getattr(info, "transform_descriptors", None):
        return f"is stored with transforms {info.transform_descriptors} (compression is not read)"
    if file not in sizes:
        sizes[file] = (root / file).stat().st_size if (root / file).is_file() else -1
    if sizes[file] < 0:
        return f"is in {file}, which is missing (a missing shard file)"
    if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length > 0):
        return f"has byte range {offset!r} + {length!r}"
    if offset + length > sizes[file]:
        return (f"lies at bytes [{offset}, {offset + length}) of {file}, which has {sizes[file]} bytes (a truncated "
                "file)")
    if length < math.prod(csizes) * dtype.itemsize:
        return f"has {length} bytes, fewer than its {csizes} {dtype} data"
    return SavedChunk(offsets, csizes, file, offset, length)


def _coverage_problems(key: str, shape: tuple[int, ...], chunks: list[SavedChunk]) -> list[str]:
    """No element in two chunks, and each in one, but for whole missing (layer, expert) slices (layers without it)."""
    cuts = [sorted({0, s, *(c.offsets[d] for c in chunks), *(c.offsets[d] + c.sizes[d] for c in chunks)})
            for d, s in enumerate(shape)]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > MAX_GRID_CELLS:
        return [f"{key}: {len(chunks)} chunks cut the tensor into {cells} cells, more than {MAX_GRID_CELLS} to check"]
    index = [{x: i for i, x in enumerate(cut)} for cut in cuts]
    grid = np.zeros([len(c) - 1 for c in cuts], dtype=np.int32)
    for c in chunks:
        grid[tuple(slice(at[o], at[o + n]) for at, o, n in zip(index, c.offsets, c.sizes))] += 1
    twice = int((grid > 1).sum())
    lead = min(leading_axes(key), grid.ndim)
    holes = grid.reshape(grid.shape[:lead] + (-1,)) if lead else grid.reshape(1, -1)
    partial = int(((holes == 0).any(-1) & (holes > 0).any(-1)).sum()) if holes.size else 0
    if lead == 0 and holes.size and (holes == 0).any():
        partial = int((holes == 0).sum())
    if twice or partial:
        return [f"{key}: its chunks write {twice} cells of the chunk grid more than once and leave {partial} "
                "slices partly unwritten (chunks must tile the tensor, or whole layers of it)"]
    return []


def leading_axes(key: str) -> int:
    """Stacked axes in front of a layer's tensor: (layer,) or (layer, expert) for decoder layers, none otherwise."""
    return 0 if not key.startswith("decoder.layers.") else 2 if ".experts.experts." in key else 1


class _Window(io.RawIOBase):
    """One record of a shard file as a read-only file for zipfile, its reads counted into `bytes_read`."""

    def __init__(self, ckpt: Checkpoint, saved: SavedTensor, chunk: SavedChunk) -> None:
        self.ckpt, self.saved, self.chunk, self.pos = ckpt, saved, chunk, 0

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = max(0, (pos, self.pos + pos, self.chunk.length + pos)[whence])
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.chunk.length - self.pos if n is None or n < 0 else min(n, self.chunk.length - self.pos)
        if n <= 0:
            return b""
        data = self.ckpt._read_into(self.saved, self.chunk, self.chunk.offset + self.pos, bytearray(n))
        self.pos += n
        return data


class _Storage:
    def __init__(self, *key: Any) -> None:
        self.key = key


class _RecordUnpickler(pickle.Unpickler):
    """Reads a torch.save record's data.pkl far enough to learn its tensor's layout; builds nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: ("tensor", storage, offset, tuple(size), tuple(stride))
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name.endswith("Storage"):
            return name
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return _Storage(*pid) if isinstance(pid, tuple) else None


def _plain_data_start(window: _Window, sizes: tuple[int, ...], dtype: torch.dtype) -> int | None:
    try:
        with zipfile.ZipFile(window) as z:
            names = {i.filename.split("/", 1)[-1]: i for i in z.infolist()}
            pkl, data, order = names.get("data.pkl"), names.get("data/0"), names.get("byteorder")
            if pkl is None or data is None or len(names.keys() & {n for n in names if n.startswith("data/")}) != 1 \
                    or data.compress_type != zipfile.ZIP_STORED or pkl.file_size > 1 << 16 \
                    or data.file_size != math.prod(sizes) * dtype.itemsize:
                return None
            if (z.read(order).decode() if order is not None else "little") != sys.byteorder:
                return None
            what = _RecordUnpickler(io.BytesIO(z.read(pkl))).load()
            strides = tuple(math.prod(sizes[d + 1:]) for d in range(len(sizes)))
            if not (isinstance(what, tuple) and what[0] == "tensor" and isinstance(what[1], _Storage)
                    and what[1].key[2:3] == ("0",) and what[2:] == (0, tuple(sizes), strides)):
                return None
            window.seek(data.header_offset)
            header = window.read(30)
            if len(header) != 30 or header[:4] != b"PK\x03\x04":
                return None
            start = data.header_offset + 30 + int.from_bytes(header[26:28], "little") + \
                int.from_bytes(header[28:30], "little")
            return start if start + data.file_size <= window.chunk.length else None
    except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError, UnicodeDecodeError, IndexError):
        return None  # not the plain form: decoded whole by torch.load, which says what is wrong
