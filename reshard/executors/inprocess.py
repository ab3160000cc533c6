"""The inprocess executor: every rank in this process, the plan bound once (frequent refits: LoRA adapters, an
in-process engine).

Construction checks the tensors once, folds the ops into a short copy program and binds it to views
(executors.copies); on one GPU the program is captured as a CUDA graph at the second refit (executors.graphs),
thousands of large copies go through one table-copy kernel (kernels.copy_table), and checksum="sum64" copies and
sums in one kernel (kernels.copy_sum64). The tensors must stay the same objects between refits: `refit` checks
their storage pointers and refuses if one was replaced.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from ..errors import ExecutionError
from ..kernels import triton_available
from ..planner import Plan
from ..planner.plan import RELAY
from .base import Executor, RankTensors, RefitStats
from .checksum import algorithm, blocks_digest
from .copies import DST, SRC, CopyViews, Memory, view_copies
from .delta import DeltaPolicy, DeltaState, check_policy, keyframe_report
from .graphs import STREAMS, Pins, Replay, on_streams, single_cuda_device, spread
from .reference import apply_shifts, ops_here
from .partition import Prepared, op_copies, row_pieces

GRAPH = "auto"  # default graph mode on one GPU (see InProcessExecutor)
MANY_COPIES = 1000  # "auto": from this many large copies on, the whole refit one graph (launch-bound otherwise)
TABLE_FROM = 1000  # table None: the large copies through one table-copy kernel from this many on (CUDA, Triton)


class InProcessExecutor(Executor):
    """Every rank in this process, views bound once (module docstring); `binding` and `process` are not needed.

    Args:
        ops: run only these plan ops (default all this process's destination ranks receive).
        graph: on one GPU, "all" (the whole refit one CUDA graph), "small" (small copies and shifts a graph, large
            ones plain device copies), "none", or "auto" ("all" from MANY_COPIES large copies on: thousands are
            launch-bound; else "small"); True is GRAPH, False "none".
        streams: side streams the large copies spread over on a GPU (default graphs.STREAMS).
        table: large copies as one table-copy kernel launch (Triton); None: on one GPU from TABLE_FROM on.
        checksum: the algorithm (executors.checksum) of the refit's digest; `checksum_kernel` forces or forbids
            the fused copy-and-sum kernel for "sum64" (None: on one GPU with Triton).
        delta: a `DeltaPolicy` (executors.delta): sender and receiver both here, no wire; `last_delta` (a
            DeltaReport, else None) reports what each refit moved.

    Raises:
        ExecutionError: a bad `graph`, `table=True` without Triton, relays, or tensors that do not match.
    """

    name = "inprocess"
    last_delta = None  # each refit's DeltaReport with the `delta` option (no protocol object: both sides are here)

    def __init__(self, plan: Plan, binding: object = None, process: int = 0, src: RankTensors | None = None,
                 dst: RankTensors | None = None, ops: "np.ndarray | None" = None, graph: "bool | str" = True,
                 streams: "int | None" = None, table: "bool | None" = None, checksum: "bool | str" = False,
                 checksum_kernel: "bool | None" = None, delta: "DeltaPolicy | None" = None) -> None:
        self.plan, self.process, self._version = plan, process, 0
        self.checksum = algorithm(checksum)
        src, dst, o = dict(src or {}), dict(dst or {}), plan.ops
        mine, used = ops_here(plan, src, dst, ops)  # only the tensors the ops touch need be there
        if np.any(o["src_side"][mine] == RELAY):
            raise ExecutionError("the plan relays between destination replicas; compile it without fan-out to "
                                 "run it bound in one process")
        ids = None if ops is None else (set(o["src_tensor"][mine].tolist()), set(o["dst_tensor"][mine].tolist()))
        prepared = Prepared(plan, {r: src[r] for r in used}, dst, ids=ids)
        self._mine, self._src_flat, self._dst_flat = mine, prepared.src_flat, prepared.dst_flat
        self._pins = Pins(prepared.tensors)
        program = op_copies(plan, mine, SRC, DST)
        flats = {SRC: prepared.src_flat, DST: prepared.dst_flat}
        self._program = view_copies(program, Memory(lambda kind, i: flats[kind][i], plan.itemsize), plan.itemsize)
        self._shifts = prepared.shifts(mine)
        self.ops, self.copies, self.bytes = len(mine), len(program), int(program.numel) * plan.itemsize
        graph = GRAPH if graph is True else "none" if graph is False else graph
        if graph not in ("all", "small", "none", "auto"):
            raise ExecutionError(f"graph must be 'all', 'small', 'none', 'auto' or a bool, not {graph!r}")
        self._device = single_cuda_device(prepared.tensors)
        self._fused, self._sum_blocks = None, []
        if checksum_kernel is None:
            checksum_kernel = self._device is not None and triton_available()
        if self.checksum == "sum64" and checksum_kernel:
            from ..kernels.copy_sum64 import CopySum64

            entries, count = stream_entries(plan, mine, prepared.src_flat, prepared.dst_flat)
            self._fused = CopySum64(entries, prepared.device or torch.device("cpu"), count)
            self._program.large, self._program.groups = [], []  # all of it moved by the kernel
        elif self.checksum:
            self._sum_blocks = prepared.blocks(mine)
        self._policy, self.last_delta = delta, None
        if delta is not None:
            state = check_policy(delta).state or DeltaState()  # the sides kept between executors, else this one's
            self._sender, self._receiver = state.sender(plan, mine), state.receiver(plan)
            if self.checksum:  # the resulting weights: the destination blocks of the ops
                self._sum_blocks = prepared.blocks(mine, "dst")
        large = self._program.large
        if table is None:
            table = self._device is not None and len(large) >= TABLE_FROM and triton_available()
        elif table and not triton_available():
            raise ExecutionError("table=True needs Triton (kernels.copy_table)")
        self._table = None
        if table and large:
            from ..kernels.copy_table import CopyTable

            self._table, large = CopyTable(large), []
        if graph == "auto":
            graph = "all" if self._table is not None or len(large) >= MANY_COPIES else "small"
        self.graph = graph
        n = (STREAMS if streams is None else int(streams)) if self._device is not None else 1
        self._large = [CopyViews(part, [], len(part)).run for part in spread(large, n, lambda ds: ds[0].numel())]
        self._large_eager = graph == "small"
        self._run = Replay(self._launch, self._device if graph != "none" else None)

    def _copy_large(self) -> None:
        if self._table is not None:
            self._table.launch()
        on_streams(self._large, self._device)

    def _launch(self) -> None:
        if self._fused is not None:
            self._fused.launch()
        if not self._large_eager:
            self._copy_large()
        for d, s in self._program.groups:
            torch._foreach_copy_(d, s)
        apply_shifts(self._shifts)

    def refit(self, version: int | None = None) -> RefitStats:
        start = time.perf_counter()
        self._pins.check()  # a replaced storage would be written through stale views
        new, delta = self._version + 1 if version is None else int(version), self._policy is not None
        if delta and not self._sender.keyframe_due(self._policy) and self._receiver.held == self._sender.base:
            try:
                payload, encoded = self._sender.encode(self._mine, new, self._src_flat)
                self._receiver.apply(self._receiver.read(payload, self._mine, "this process"), self._dst_flat)
            except Exception:
                self._sender.forget()
                raise
            report = self.last_delta = self._sender.report(self._mine, [encoded], new, payload.numel())
            phase, ops, copies, moved = "delta", self.ops, report.entries, report.wire_bytes
        else:
            with torch.no_grad():
                if self._large_eager:  # plain device copies, ahead of the graph on the same stream
                    self._copy_large()
                self._run()
            if delta:
                self.last_delta = keyframe_report(self.plan, self._mine, new)
            phase, ops, copies, moved = "launch", self.ops, self.copies, self.bytes
        if delta:  # both sides hold the new version
            self._sender.committed(new, self._src_flat, phase == "launch")
            self._receiver.held = new
        self._version, digest = new, ""
        if self._fused is not None and not delta:  # the kernel that moved the bytes summed them (no host sync)
            digest = self._fused.digest().hex()
        elif self.checksum:
            digest = blocks_digest(self.checksum, self._sum_blocks).hex()
        seconds = time.perf_counter() - start  # launched: on a GPU the copies may still be running
        return RefitStats(executor=self.name, process=self.process, version=new, seconds=seconds,
                          phases={phase: seconds}, ops=ops, copies=copies, local_bytes=moved,
                          checksum=self.checksum or "", digest=digest)

    def close(self) -> None:
        self._program, self._shifts, self._pins, self._run, self._large = None, [], Pins(()), None, []
        self._table, self._fused, self._sum_blocks = None, None, []


def stream_entries(plan: Plan, mine: np.ndarray, s_flat: dict, d_flat: dict) -> tuple[np.ndarray, int]:
    """The ops `mine` (plan order) as contiguous copies (src address, dst address, nbytes, stream position), one
    per row, merged where they continue each other on both sides (partition.row_pieces); and the stream's length
    in bytes."""
    p, size = row_pieces(plan, np.asarray(mine, dtype=np.int64), staged=False), plan.itemsize

    def address(flat: dict, ids: np.ndarray, off: np.ndarray) -> np.ndarray:
        tensors, which = np.unique(ids, return_inverse=True)
        base = np.asarray([flat[int(t)].data_ptr() for t in tensors.tolist()], dtype=np.int64)
        return base[which.reshape(-1)] + off * size

    nbytes = p["numel"] * size
    entries = [address(s_flat, p["send_id"], p["send_off"]), address(d_flat, p["recv_id"], p["recv_off"]), nbytes,
               np.cumsum(nbytes) - nbytes]
    return np.stack(entries, axis=1).astype(np.int64), int(nbytes.sum())
