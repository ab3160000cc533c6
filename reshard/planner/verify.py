"""A saved plan is untrusted input: loading re-proves what it claims before a Plan exists.

`read_saved` reads a saved plan's bytes: a JSON file, or an .npz (a zip of .npy arrays and a JSON header), opened
without pickle, each member's size and dtype checked from its .npy header before it is read, so a hostile file can
neither run code nor make the reader allocate more than the limits allow. `load_plan` then checks, raising
PlanFileError naming the entry to blame: 1. the header's entries have their JSON types and the layouts are valid; 2.
the tensor tables' ranks, kinds and shapes; 3. the program's arrays: integer arrays of the expected shapes, every
index inside what it indexes (planner.program.check_program); 4. the digest is present and matches the content; 5.
what the content claims, in time linear in its ops: every op reads and writes inside its tensors, the tables are the
layouts' physical tensors, the ops write every destination element holding model data exactly once
(planner.coverage, as the compiler proves it), and the bounds are the layouts'.
"""
from __future__ import annotations

import math
import os
import re
import stat
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from ..arrays import unique_inverse
from ..errors import CoverageError, PlanError, PlanFileError, ReshardError
from ..layouts import layout_from_dict
from ..layouts.model import DTYPE_SIZES
from ..limits import MAX_PARAMS, MAX_PLAN_ELEMENTS, MAX_PLAN_HEADER_BYTES, MAX_RANKS
from ..untrusted import parse_json, read_bytes
from .accounting import Bounds
from .compiler import colocation_ranks
from .coverage import prove_expert_slots, prove_program
from .program import BIG, COPY_COLUMNS, OP_TABLES, Program, bad, same, within
from .selection import bound_facts, data_rows, select_indices, unit_placements
from .tables import FORMAT_VERSION, TensorTable

COPY_NAMES = tuple(f"c.{c}" for c in COPY_COLUMNS)  # optional: plans saved before EPLB slot copies have none
ARRAY_NAMES = tuple(p + c for p, cols in OP_TABLES.values() if p != "c." for c in cols) + Program.ARRAYS
MAX_MEMBERS = 64  # of a saved .npz


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
            read = {}
            for m in members:
                name = m.filename[:-4] if m.filename.endswith(".npy") else None
                if name is None or not (name == "header" or name.startswith("a:")):
                    raise bad("path", m.filename, "is not a member of a saved plan")
                read[name] = _read_member(z, m, name)
    except PlanFileError:
        raise
    except Exception as e:  # noqa: BLE001 - zip, zlib and numpy's .npy parsing raise many types on bad bytes
        raise bad("path", str(path), f"is not a readable saved plan (.npz): {type(e).__name__}: {e}") from None
    header = read.pop("header", None)
    if header is None:
        raise bad("header", None, "is missing from the .npz")
    if header.dtype != np.uint8 or header.ndim != 1:
        raise bad("header", str(header.dtype), "must be the UTF-8 bytes of a JSON object")
    return parse_json(header.tobytes(), bad, "header", str(path)), {k[2:]: v for k, v in read.items()}


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


def int_array(field: str, value: Any, ndim: int = 1) -> np.ndarray:
    """An integer array from a saved plan (a numpy array from .npz, nested lists from JSON), as int64; anything
    else (floats, booleans, strings, ragged lists, other shapes, values past int64) is refused."""
    if isinstance(value, np.ndarray):
        a = value
    elif isinstance(value, list):
        rows = value if value and isinstance(value[0], list) else [value]
        if any(bool in set(map(type, r)) for r in rows if isinstance(r, list)):  # numpy would make true a 1
            raise bad(field, "<list>", "holds a boolean where integers belong")
        try:
            a = np.asarray(value)
        except (ValueError, TypeError, OverflowError) as e:
            raise bad(field, "<list>", f"is not a rectangular array of integers ({e})") from None
    else:
        raise bad(field, value, f"must be an array of integers, not {type(value).__name__}")
    if a.size > MAX_PLAN_ELEMENTS:
        raise bad(field, a.shape, f"has more than {MAX_PLAN_ELEMENTS:,} elements")
    if a.ndim != ndim:
        raise bad(field, a.shape, f"must have {ndim} dimension{'s' * (ndim > 1)}")
    if a.size == 0:
        return np.zeros(a.shape, dtype=np.int64)
    if a.dtype.kind not in "iu":
        raise bad(field, str(a.dtype), "must hold integers")
    if a.dtype.kind == "u" and int(a.max()) >= 1 << 63:
        raise bad(field, int(a.max()), "holds a value past int64")
    return np.ascontiguousarray(a, dtype=np.int64)


def _layouts(d: dict[str, Any]) -> tuple[Any, Any]:
    out = []
    for side in ("src", "dst"):
        try:
            out.append(layout_from_dict(d.get(side)))
        except ReshardError as e:
            raise PlanFileError(f"plan file: {side} layout is invalid: {e}", field=side) from e
    src, dst = out
    if src.model != dst.model:
        raise bad("dst.model", str(dst.model), f"differs from the source's model {src.model}")
    return src, dst


_REQUIRED = object()  # an entry's default: the entry must be given
_BOOL = (lambda v: isinstance(v, bool), "must be true or false")


def _integer(low: int, high: int = BIG) -> tuple[Any, str]:
    """The test of an entry holding a JSON integer in [low, high]."""
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and low <= v <= high, \
        f"must be a JSON integer in [{low}, {high}]"


# entry -> (default, (test, rule) ...), the tests run in order (not on a null entry whose default is null); the
# layouts, tables, bounds, program and arrays are checked apart
HEADER = {
    "format": (_REQUIRED, (lambda v: v == FORMAT_VERSION and not isinstance(v, bool),
                           f"is not supported (expected {FORMAT_VERSION})")),
    **{k: (_REQUIRED,) for k in ("src", "dst", "src_tensors", "dst_tensors", "bounds", "program")},
    "colocation": (None,), "arrays": (None,), "fanout": (None, _integer(1, MAX_RANKS)),
    "roots": (None, _integer(1, MAX_RANKS)), "colocated": (_REQUIRED, _BOOL),
    "digest": (_REQUIRED, (lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) is not None,
                           "must be the plan's SHA-256 digest (64 lowercase hex digits); a plan without one is "
                           "refused")),
    "coverage": (_REQUIRED, (lambda v: v == "exact", "must be 'exact' (a plan claims nothing else)")),
    "compile_seconds": (0.0, (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e9,
                              "must be a finite number of seconds >= 0")),
    "selection": (None, (lambda v: isinstance(v, list) and v and all(isinstance(x, str) for x in v),
                         "must be null or a non-empty list of tensor names"),
                  (lambda v: len(set(v)) == len(v), "lists a tensor twice"))}
PROGRAM = {"ranks_per_replica": (_REQUIRED, _integer(1, MAX_RANKS)),
           "tensors_per_replica": (_REQUIRED, _integer(0, MAX_PLAN_ELEMENTS))}
BOUNDS = {"lower_bound_by_dst": (_REQUIRED,), "model_bytes": (_REQUIRED, _integer(0)),
          **{k: (0, _integer(0)) for k in ("gatherer_held_bytes", "egress_lower_bound", "egress_unit_max")},
          "holder_sets_laminar": (True, _BOOL)}
TABLE = {"rank": (_REQUIRED,), "kind": (_REQUIRED,),
         "kinds": (_REQUIRED, (lambda v: isinstance(v, list) and len(v) <= MAX_PLAN_ELEMENTS,
                               "must be a list of [name, shape] pairs")),
         "dtypes": ([], (lambda v: isinstance(v, list) and all(x == "" or x in DTYPE_SIZES for x in v),
                         f"must list one dtype per kind ('' or one of {sorted(DTYPE_SIZES)})"))}
ARRAYS = {n: (_REQUIRED,) for n in ARRAY_NAMES + COPY_NAMES}


def _object(field: str, d: Any, entries: dict[str, tuple]) -> dict[str, Any]:
    """JSON object `d` with its `entries` checked (defaults filled in); an unknown, missing or failing entry is
    refused naming it (`field.entry`; the header's entries by their own names)."""
    if not isinstance(d, dict):
        raise bad(field, type(d).__name__, f"must be a JSON object of {sorted(entries)}")
    prefix = "" if field == "header" else f"{field}."
    unknown = [k for k in d if k not in entries]  # keys of any type (JSON's are strings, a dict's need not be)
    if unknown:
        raise bad(f"{prefix}{unknown[0]}", d[unknown[0]],
                  f"is not an entry of the {field} (entries: {sorted(entries)})")
    out = {}
    for key, (default, *tests) in entries.items():
        value = out[key] = d.get(key, default)
        if value is _REQUIRED:
            raise bad(prefix + key, None, "is missing")
        for test, rule in tests if value is not None or default is not None else ():
            if not test(value):
                raise bad(prefix + key, value, rule)
    return out


def _table(field: str, d: Any) -> TensorTable:
    """A tensor table entry; its tensors are proven to be the layout's once the plan is built (`_match`)."""
    d = _object(field, d, TABLE)
    rank, kind = int_array(f"{field}.rank", d["rank"]), int_array(f"{field}.kind", d["kind"])
    if len(rank) != len(kind):
        raise bad(f"{field}.kind", len(kind), f"must have as many entries as {field}.rank ({len(rank)})")
    parsed = []
    for i, k in enumerate(d["kinds"]):
        ok = isinstance(k, list) and len(k) == 2 and isinstance(k[0], str) and 0 < len(k[0]) <= 1024 and \
            isinstance(k[1], list) and 1 <= len(k[1]) <= 8 and \
            all(isinstance(x, int) and not isinstance(x, bool) and 0 < x <= MAX_PARAMS for x in k[1])
        if not ok or math.prod(k[1]) > MAX_PARAMS:
            raise bad(f"{field}.kinds[{i}]", k, "must be [name, shape] with a shape of positive integers "
                      f"holding at most {MAX_PARAMS:,} elements")
        parsed.append((k[0], tuple(k[1])))
    if d["dtypes"] and len(d["dtypes"]) != len(parsed):
        raise bad(f"{field}.dtypes", d["dtypes"], f"must list one dtype per kind ({len(parsed)})")
    within(f"{field}.kind", kind, 0, len(parsed))
    table = TensorTable(rank, kind, tuple(parsed), tuple(d["dtypes"]))
    if (table.find(table.rank, table.names) != np.arange(len(table))).any():
        raise bad(f"{field}.kinds", "...", "lists one (rank, tensor name) twice")
    return table


def _bounds(d: Any) -> Bounds:
    """The bounds entry; its figures from the layouts are proven once the plan is built (`_prove`)."""
    b = _object("bounds", d, BOUNDS)
    return Bounds(**{**b, "lower_bound_by_dst": tuple(int_array("bounds.lower_bound_by_dst",
                                                                b["lower_bound_by_dst"]).tolist())})


def _program(arrays: Any, scalars: dict[str, int]) -> Program:
    if isinstance(arrays, dict) and not any(n in arrays for n in COPY_NAMES):
        arrays = {**arrays, **{n: np.zeros(0, np.int64) for n in COPY_NAMES}}
    a = {n: int_array(f"arrays.{n}", v, 2 if n in ("choice", "parent", "stage") else 1)
         for n, v in _object("arrays", arrays, ARRAYS).items()}
    groups = [[prefix + c for c in cols] for prefix, cols in OP_TABLES.values()]
    for group in groups + [["box_hstart", "box_hcount"], ["h_rank", "h_tensor", "h_base", "h_stride"]]:
        for name in group[1:]:
            if len(a[name]) != len(a[group[0]]):
                raise bad(f"arrays.{name}", len(a[name]), f"must have {len(a[group[0]])} entries like "
                          f"arrays.{group[0]}")
    return Program(**{attr: {c: a[prefix + c] for c in cols} for attr, (prefix, cols) in OP_TABLES.items()},
                   **{n: a[n] for n in Program.ARRAYS}, **scalars)


def _reads_inside(p: Program, src_numel: np.ndarray) -> None:
    """Every op of every fed replica reads inside its holder's source tensor (the holder each replica chose)."""
    t = p.template
    rows, cols = t["rows"], t["cols"]
    for f in range(len(p.fed)):
        h = p.box_hstart[t["box"]] + p.choice[f][t["group"]]
        stride = np.where(rows == 1, cols, p.h_stride[h])
        narrow = np.flatnonzero((rows > 1) & (stride < cols))
        # all factors are below 2**47 (checked): float products decide overflow before int64 arithmetic
        big = p.h_base[h] + t["src_d0"].astype(float) * p.h_stride[h] + t["src_d1"] + (rows - 1.0) * stride + cols
        last = p.h_base[h] + t["src_d0"] * p.h_stride[h] + t["src_d1"] + (rows - 1) * stride + cols
        outside = np.flatnonzero((big > 2.0 ** 61) | (last > src_numel[p.h_tensor[h]]))
        for idx, what in ((narrow, "has a row stride narrower than its columns"),
                          (outside, "reads past the end of its source tensor")):
            if len(idx):
                i = int(idx[0])
                raise bad(f"arrays.t.src_d0[{i}]", int(t["src_d0"][i]), f"{what} (fed replica {int(p.fed[f])}, "
                          f"source tensor {int(p.h_tensor[h[i]])}; {len(idx)} ops do)")


def _match(field: str, table: Any, placements: Any) -> np.ndarray:
    """Table id of each placement row; the placements' physical tensors must be the table's, and the table no
    more. Shapes compared in units of the plan's dtype."""
    nk = max(len(placements.kinds), 1)
    first, inverse = unique_inverse((placements.rank * nk + placements.kind,))
    ranks, kinds = placements.rank[first].tolist(), placements.kind[first].tolist()
    tid = table.find(ranks, [placements.kinds[k][0] for k in kinds])
    for r, k, i in zip(ranks, kinds, tid.tolist()):
        name, shape = placements.kinds[k]
        if i < 0:
            raise bad(field, f"rank {r} {name}", "lacks a tensor the layout places data in")
        if table.shape(i) != tuple(shape):
            raise bad(field, f"rank {r} {name}", f"has shape {table.shape(i)}; the layout's is {tuple(shape)}")
    if len(set(tid.tolist())) != len(table):
        extra = sorted(set(range(len(table))) - set(tid.tolist()))[0]
        raise bad(field, f"rank {table.rank[extra]} {table.name(extra)}", "is not a tensor of the layout")
    return tid[inverse.reshape(-1)]


def _prove(plan: Any, sel: np.ndarray) -> None:
    """Step 5 of the module docstring, on a plan whose indices `check_program` found inside what they index."""
    p, model, K = plan.program, plan.src.model, plan.dst.num_replicas
    table, T0 = plan.dst_tensors, p.tensors_per_replica
    table0 = TensorTable(table.rank[:T0], table.kind[:T0], table.kinds, table.dtypes)
    tiled = table0.tiled(K, p.ranks_per_replica)
    same("dst_tensors.rank", table.rank, tiled.rank, "replica k's tensors are replica 0's on ranks shifted by k x "
         "ranks per replica")
    same("dst_tensors.kind", table.kind, tiled.kind, "every replica holds replica 0's tensors")
    S, _, D, _ = unit_placements(plan.src, plan.dst, sel)
    _match("src_tensors", plan.src_tensors, data_rows(S))
    d_tid, D = _match("dst_tensors", table0, D)[D.n0 * D.n1 > 0], data_rows(D)
    in_sel = np.zeros(len(model.canonical), dtype=bool)
    in_sel[sel] = True
    for prefix, ops in (("arrays.t.canon", p.template), ("arrays.r.canon", p.relay), ("arrays.c.canon", p.copies)):
        off = np.flatnonzero(~in_sel[ops["canon"]])
        if len(off):
            raise bad(f"{prefix}[{int(off[0])}]", int(ops["canon"][off[0]]), "is a tensor outside the selection")
    _reads_inside(p, plan.src_tensors.numel())
    try:
        prove_program(p.template, p.relay if len(p.fed) < K else None, p.copies, table0, d_tid, D)
        # an EPLB destination: every physical slot (each replica of an expert) is model data, so written
        prove_expert_slots(plan.dst.expert_stacks(), table0, d_tid, D, whole=plan.selection is None)
    except CoverageError as e:
        raise PlanFileError("plan file: the ops do not write every destination element holding model data "
                            "exactly once", e.problems, field="arrays") from None
    lower_bound_by_dst, model_bytes = bound_facts(model, sel, D, p.ranks_per_replica, K)
    if tuple(plan.bounds.lower_bound_by_dst) != lower_bound_by_dst:
        raise bad("bounds.lower_bound_by_dst", list(plan.bounds.lower_bound_by_dst)[:8], "is not what the "
                  "destination layout holds")
    if plan.bounds.model_bytes != model_bytes:
        raise bad("bounds.model_bytes", plan.bounds.model_bytes, f"must be {model_bytes} (the selection's bytes)")


def load_plan(cls: type, d: Any, arrays: Any) -> Any:
    """The Plan a saved header and its arrays describe, once every check of the module docstring passed."""
    d = _object("header", d, HEADER)
    src, dst = _layouts(d)
    colocated = d["colocated"]
    if d["colocation"] is not None:
        if not colocated:
            raise bad("colocation", d["colocation"], "is given but colocated is false")
        colocated = int_array("colocation", d["colocation"]).tolist()
    try:
        colocation = colocation_ranks(colocated, src.num_ranks, dst.num_ranks)
    except PlanError as e:
        raise bad("colocated" if d["colocation"] is None else "colocation", colocated, str(e)) from None
    try:
        sel = select_indices(src.model, d["selection"], None)
    except PlanError as e:
        raise bad("selection", d["selection"], str(e)) from None
    program = _program(d["arrays"] if arrays is None else arrays, _object("program", d["program"], PROGRAM))
    fanout, roots, fed = d["fanout"], d["roots"], len(program.fed)
    if (fanout is None) != (roots is None) or (fanout is None and fed != dst.num_replicas) or \
            (roots is not None and roots != fed):
        raise bad("roots", roots, f"must be null without fanout (every replica fed), else the {fed} fed replicas")
    plan = cls(src=src, dst=dst, src_tensors=_table("src_tensors", d["src_tensors"]),
               dst_tensors=_table("dst_tensors", d["dst_tensors"]), program=program, bounds=_bounds(d["bounds"]),
               colocation=colocation, fanout=fanout, roots=roots, coverage="exact",
               selection=tuple(d["selection"]) if d["selection"] is not None else None,
               compile_seconds=float(d["compile_seconds"]))
    if plan.digest != d["digest"]:
        raise bad("digest", d["digest"][:12], f"does not match the content (whose digest is {plan.digest[:12]}): "
                  "the file was changed or damaged")
    _prove(plan, sel)
    return plan


__all__ = ["bad", "int_array", "load_plan", "read_saved", "within"]
