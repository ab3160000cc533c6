"""Quantizing refits run by any executor: senders quantize before the plan moves bytes, receivers after.

Numerics (`quantize_blocks`), per block of (rows, cols), as DeepGEMM's / vLLM's `per_block_cast_to_fp8`: amax =
max |x| over the block in float32, at least 1e-4; scale = amax / 448; q = float8_e4m3fn(x * (1 / scale)) (round to
nearest even); the stored `weight_scale_inv` is `scale`. Partial edge blocks take the amax of what they hold.

`Fp8Executor` wraps the executor a plan would use around an `Fp8Plan`: source ranks quantize into fp8 and scale
shadows, the inner executor moves the plan (staged by default: weights and scales commit together or not at
all), then destination ranks quantize their staging tensors into temporaries and only then write weights and
scales.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable, Mapping

import numpy as np
import torch

from ..errors import ArgumentError, ExecutionError
from ..layouts.fp8 import AMAX_FLOOR, FP8_MAX, STAGING, scale_name
from ..planner.fp8 import Fp8Plan
from ..planner.plan import RELAY
from .base import Executor, RankTensors, RefitStats, make_executor, phase_times
from ..kernels import KernelTuning, triton_available
from .graphs import Pins, Replay, on_streams, single_cuda_device
from .reference import _box, element_shape, torch_dtype

QUANTIZERS = ("auto", "eager", "kernel")


def quantize_blocks(x: torch.Tensor, block: tuple[int, int],
                    out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [n, k], float32 scales [ceil(n/bn), ceil(k/bk)]) of a 2-D tensor (module docstring), the fp8 values
    written into `out` (a strided [n, k] float8 view) when given: the reference every quantizer is checked against."""
    n, k = x.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    if (n, k) != (nb * bn, kb * bk):  # pad with zeros: they never raise an amax
        padded = torch.zeros((nb * bn, kb * bk), dtype=x.dtype, device=x.device)
        padded[:n, :k] = x
        x = padded
    v = x.reshape(nb, bn, kb, bk)
    # max |x| per block in float32: the larger of -min and max (no |x| temporary)
    amax = torch.maximum(v.amax(dim=(1, 3)), v.amin(dim=(1, 3)).neg()).float().clamp_(min=AMAX_FLOOR)
    # on tensors: CUDA divides by a Python scalar as a product with its reciprocal (can differ in the last bit)
    scale = amax / torch.full_like(amax, FP8_MAX)
    inv = torch.reciprocal(scale)[:, None, :, None]
    q = torch.mul(v, inv).reshape(nb * bn, kb * bk)[:n, :k]  # float32: cast on the way into `out`
    if out is None:
        return q.to(torch.float8_e4m3fn), scale
    out.copy_(q)
    return out, scale


def _piece(t: torch.Tensor, p) -> torch.Tensor:
    """A placement `p`'s box of `t`, as 2-D rows of its last dimension."""
    view = _box(t, p.phys_offset, p.lengths)
    return view.reshape(-1, view.shape[-1]) if view.dim() != 2 else view


def _tiles(t: torch.Tensor, pieces: list, block: tuple[int, int]) -> bool:
    """Whether 2-D `pieces` tile the 2-D tensor `t` in whole blocks (then `t` is quantized at once)."""
    if t.dim() != 2 or any(len(p.lengths) != 2 for p in pieces):
        return False
    if sum(p.lengths[0] * p.lengths[1] for p in pieces) != t.numel():
        return False  # pieces of one rank never overlap (the compiler proves it), so equal counts tile t
    return all(o % b == 0 and n % b == 0 for p in pieces for o, n, b in zip(p.phys_offset, p.lengths, block))


class _QuantizeJobs:
    """Runs (bf16 view, fp8 view, scale view) jobs: the Triton kernel (one replay, built once, launched with
    `tuning`) or a quantizer function per job."""

    def __init__(self, jobs: "list | None", block: tuple[int, int], tuning: "KernelTuning | None") -> None:
        self.jobs, self.block, self.tuning = jobs, block, tuning
        self._kernel: "Replay | None" = None

    def run(self, quantize=None, direct: bool = True) -> None:
        """Quantize every job: `quantize` "kernel", a quantizer function, or None (`quantize_blocks`)."""
        if quantize == "kernel":
            if self._kernel is None:
                self._kernel = self._kernel_program(direct)
            self._kernel()
            return
        with torch.no_grad():
            self._eager(quantize or quantize_blocks)

    def _kernel_program(self, direct: bool) -> "Replay":
        """`kernel_launches` replayed as one CUDA graph from the second call (executors.graphs)."""
        return Replay(kernel_launches(self.jobs, self.block, self.tuning),
                      single_cuda_device([t for job in self.jobs for t in job]))

    def _eager(self, quantize: Callable) -> None:
        for x, q, s in self.jobs:
            _, ss = quantize(x, self.block, q)  # fp8 straight into its destination
            s.copy_(ss)


class SenderQuantizer(_QuantizeJobs):
    """The wire's source tensors of this process's source ranks, and the quantization that fills them."""

    def __init__(self, fp: Fp8Plan, src: RankTensors, shadows: bool = True,
                 tuning: "KernelTuning | None" = None) -> None:
        plan = fp.plan
        block = fp.scheme.block
        own = plan.src_tensors.own_dtypes()
        unit = torch_dtype(plan.src.dtype)
        self.tensors: dict[int, dict[str, torch.Tensor]] = {}
        super().__init__([], block, tuning)  # jobs: (bf16 piece, fp8 piece, scale piece)
        for rank, given in src.items():
            out: dict[str, torch.Tensor] = {}
            # scales have no trainer tensor: shadows on the weight's device (known by dtype, and by the plan's pieces:
            # under a float32 trainer a scale has the trainer's own dtype)
            scales = {b.tensor for _, b in fp.sender_pieces(rank)} if shadows else set()
            device = next((t.device for t in given.values() if isinstance(t, torch.Tensor)), "cpu")
            for name, units in plan.src_tensors.on_rank(rank).items():
                dtype = torch_dtype(own.get((rank, name), plan.src.dtype))
                shape = element_shape(units, unit, dtype)
                real = given.get(name)
                if real is None:
                    if shadows and ((rank, name) in own or name in scales):
                        out[name] = torch.zeros(shape, dtype=dtype, device=device)
                elif dtype != torch.float8_e4m3fn:  # the trainer's own tensor (a float32 router bias too)
                    out[name] = real
                elif real.dtype != unit or tuple(real.shape) != tuple(shape):
                    raise ExecutionError(f"source rank {rank} {name!r}: got {tuple(real.shape)} {real.dtype}, a "
                                         f"quantizing refit reads {tuple(shape)} {unit} (a source already in "
                                         f"{real.dtype} is not re-quantized into other blocks)")
                elif shadows:  # a shadow beside the trainer's tensor (without: DirectQuantizer writes the destination)
                    out[name] = torch.zeros(shape, dtype=dtype, device=real.device)
            self.tensors[rank] = out
            if not shadows:
                continue
            pieces: dict[tuple[str, str], list] = {}
            for a, b in fp.sender_pieces(rank):
                if a.tensor not in given:
                    raise ExecutionError(f"source rank {rank} has no tensor {a.tensor!r} to quantize")
                pieces.setdefault((a.tensor, b.tensor), []).append((a, b))
            for (wname, sname), pairs in pieces.items():
                if _tiles(given[wname], [a for a, _ in pairs], block):  # one job: fewer, larger kernels
                    self.jobs.append((given[wname], out[wname], out[sname]))
                    continue
                for a, b in pairs:
                    self.jobs.append((_piece(given[wname], a), _piece(out[wname], a), _piece(out[sname], b)))


class ReceiverQuantizer(_QuantizeJobs):
    """This process's destination ranks: staging buffers for receiver-quantized tensors, and the quantization
    from them into the engine's fp8 weights and scales. `run(quantize, direct)` quantizes all first, then writes
    (weights and scales change together or not at all); with the kernel and `direct` (nothing can fail between
    the two), straight into the engine's tensors."""

    def __init__(self, fp: Fp8Plan, dst: RankTensors, tuning: "KernelTuning | None" = None) -> None:
        plan, layout, full = fp.plan, fp.plan.dst, fp.full_dst
        own = plan.dst_tensors.own_dtypes()
        unit = torch_dtype(plan.dst.dtype)
        self.tensors: dict[int, dict[str, torch.Tensor]] = {}
        super().__init__([], fp.scheme.block, tuning)  # jobs: (staging, fp8 weight, scale)
        for rank, given in dst.items():
            out = {}
            for name, units in plan.dst_tensors.on_rank(rank).items():
                wanted = torch_dtype(own[(rank, name)]) if (rank, name) in own else unit
                real = given.get(name[:-len(STAGING)] if name.endswith(STAGING) else name)
                if name.endswith(STAGING) or (real is not None and real.dtype == torch.float8_e4m3fn and
                                              wanted == unit):
                    # staging: vLLM names it after its parameter; an HF destination's is the fp8 tensor's name
                    out[name] = torch.zeros(units, dtype=unit, device=real.device if real is not None else "cpu")
            self.tensors[rank] = dict(given, **out)  # the engine's own tensors, and the staging
        fspec = full.model
        for t in fp.receiver_tensors:
            ft, fs = fspec.tensor(t.name), fspec.tensor(scale_name(t.name))
            for rank, given in dst.items():
                stage = [p for p in layout.placements(t) if p.rank == rank]
                wp = [p for p in full.placements(ft) if p.rank == rank]
                sp = [p for p in full.placements(fs) if p.rank == rank]
                for a, b, c in zip(stage, wp, sp):
                    if not all(a.lengths):
                        continue
                    for name in (b.tensor, c.tensor):
                        if name not in given:
                            raise ExecutionError(f"destination rank {rank} has no tensor {name!r} (an FP8 engine "
                                                 f"holds the weight and its scale)")
                    self.jobs.append((_piece(self.tensors[rank][a.tensor], a), _piece(given[b.tensor], b),
                                      _piece(given[c.tensor], c)))

    def _kernel_program(self, direct: bool) -> "Replay":
        if direct or not self.jobs:
            return super()._kernel_program(direct)
        temps = [(x, torch.empty_like(q), torch.empty_like(s)) for x, q, s in self.jobs]
        quantize = kernel_launches(temps, self.block, self.tuning)  # plain launches: captured in the graph below
        writes = [(q, tq, s, ts) for (_, q, s), (_, tq, ts) in zip(self.jobs, temps)]

        def run() -> None:
            quantize()
            for q, tq, s, ts in writes:
                q.copy_(tq)
                s.copy_(ts)
        return Replay(run, single_cuda_device([t for job in self.jobs for t in job]))

    def _eager(self, quantize: Callable) -> None:
        done = [quantize(x, self.block) for x, _, _ in self.jobs]
        for (_, q, s), (qq, ss) in zip(self.jobs, done):
            q.copy_(qq)
            s.copy_(ss)


def kernel_launches(jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], block: tuple[int, int],
                    tuning: "KernelTuning | None" = None) -> Callable[[], None]:
    """A function that quantizes every (x, fp8 view, scale view) job: in one launch of kernels.fp8_quantize
    (with `tuning`), those with rows not contiguous through the reference."""
    from ..kernels.fp8_quantize import QuantizeTable

    fits = [x.dim() == 2 and q.dim() == 2 and s.dim() == 2 and x.stride(-1) == 1 and q.stride(-1) == 1
            for x, q, s in jobs]
    table = QuantizeTable([job for job, fit in zip(jobs, fits) if fit], block, tuning)
    rest = [job for job, fit in zip(jobs, fits) if not fit]

    def run() -> None:
        with torch.no_grad():
            table.launch()
            for x, q, s in rest:
                _, ss = quantize_blocks(x, block, q)
                s.copy_(ss)
    return run


def _rect(off: int, stride: int, rows: int, cols: int, width: int) -> "tuple[int, int, int, int] | None":
    """A flat tensor's block (offset, row stride, rows x cols) as (row, col, rows, cols) of the tensor in rows of
    `width`; None when not a rectangle there."""
    r0, c0 = divmod(off, width)
    if rows == 1:
        if c0 == 0 and cols % width == 0:
            return r0, 0, cols // width, width
        return (r0, c0, 1, cols) if c0 + cols <= width else None
    return (r0, c0, rows, cols) if stride == width and c0 + cols <= width else None


def _as_rows(t: torch.Tensor, block_rows: int) -> "torch.Tensor | None":
    """A weight as 2-D rows of its last dimension where its blocks stay whole that way; else None."""
    if t.dim() == 2:
        return t
    if t.dim() > 2 and t.shape[-2] % block_rows == 0:
        return t.reshape(-1, t.shape[-1])
    return None


class DirectQuantizer(_QuantizeJobs):
    """Sender quantization straight into the destination, every rank in this process: each fp8 op becomes a job
    from the trainer's bf16 rectangle into the engine's fp8 rectangle and scales (no shadow, no copy); `rest` are
    the other ops. `jobs` is None (and `why` says why) where the plan cannot run so."""

    def __init__(self, fp: Fp8Plan, src: RankTensors, dst: RankTensors, tuning: "KernelTuning | None" = None) -> None:
        super().__init__(None, fp.scheme.block, tuning)
        self.rest: "np.ndarray | None" = None
        self.why = ""
        plan, (bn, bk) = fp.plan, fp.scheme.block
        o = plan.ops
        mine = np.flatnonzero(np.isin(o["dst_rank"], list(dst)))
        s_own, d_own = plan.src_tensors.own_dtypes(), plan.dst_tensors.own_dtypes()
        s_names = list(zip(plan.src_tensors.ranks, plan.src_tensors.names))
        d_names = list(zip(plan.dst_tensors.ranks, plan.dst_tensors.names))
        fp8 = {i for i, key in enumerate(s_names) if s_own.get(key) == "float8_e4m3fn"}
        scales = {i for i, key in enumerate(s_names)
                  if s_own.get(key) == "float32" and key[1] not in src.get(key[0], {})}
        ratio = plan.itemsize  # fp8 elements per plan unit
        is8 = np.isin(o["src_tensor"][mine], list(fp8))
        for rank in src:  # the senders' pieces start on the block grid: its blocks are the tensor's own
            for a, _ in fp.sender_pieces(rank):
                t = src[rank].get(a.tensor)
                lead = a.phys_offset[:-2]
                row = (int(np.ravel_multi_index(lead, t.shape[:-2])) * t.shape[-2] if lead else 0) + a.phys_offset[-2] \
                    if t is not None and t.dim() >= 2 and len(a.phys_offset) == t.dim() else None
                if row is None or row % bn or a.phys_offset[-1] % bk:
                    self.why = f"a piece of {a.tensor} starts off the block grid"
                    return
        jobs, scale_elements = [], 0
        shifted = set(plan.value_shifts)
        for i in mine[is8].tolist():
            (sr, sn), (dr, dn) = s_names[int(o["src_tensor"][i])], d_names[int(o["dst_tensor"][i])]
            x_t, q_t = src.get(sr, {}).get(sn), dst.get(dr, {}).get(dn)
            s_t = dst.get(dr, {}).get(scale_name(dn)) if dn.endswith("weight") else None
            if int(o["src_side"][i]) == RELAY or int(o["canon"][i]) in shifted or x_t is None or q_t is None \
                    or s_t is None or d_own.get((dr, dn)) != "float8_e4m3fn":
                self.why = f"op {i} ({sn} -> {dn}) is not a plain fp8 copy"
                return
            x2, q2 = _as_rows(x_t, bn), _as_rows(q_t, bn)
            s2 = s_t.reshape(-1, s_t.shape[-1]) if s_t.dim() > 2 else s_t
            if x2 is None or q2 is None:
                self.why = f"{sn} or {dn}: a stack's matrices split blocks"
                return
            a, b = (_rect(int(o[f"{side}_offset"][i]) * ratio, int(o[f"{side}_stride"][i]) * ratio, int(o["rows"][i]),
                          int(o["cols"][i]) * ratio, t.shape[1]) for side, t in (("src", x2), ("dst", q2)))
            if a is None or b is None or a[2:] != b[2:] or \
                    tuple(s2.shape) != (-(-q2.shape[0] // bn), -(-q2.shape[1] // bk)):
                self.why = f"op {i} ({sn} -> {dn}) is not a rectangle of both tensors"
                return
            nr, nc = a[2], a[3]
            whole = all(r0 % bn == 0 and c0 % bk == 0 for r0, c0, _, _ in (a, b))
            rows_ok = nr % bn == 0 or (a[0] + nr == x2.shape[0] and b[0] + nr == q2.shape[0])
            cols_ok = nc % bk == 0 or (a[1] + nc == x2.shape[1] and b[1] + nc == q2.shape[1])
            if not (whole and rows_ok and cols_ok):
                self.why = f"op {i} ({sn} -> {dn}) cuts blocks"
                return
            sb = (b[0] // bn, b[1] // bk, -(-nr // bn), -(-nc // bk))
            jobs.append((x2[a[0]:a[0] + nr, a[1]:a[1] + nc], q2[b[0]:b[0] + nr, b[1]:b[1] + nc],
                         s2[sb[0]:sb[0] + sb[2], sb[1]:sb[1] + sb[3]]))
            scale_elements += sb[2] * sb[3]
        into_scales = mine[np.isin(o["src_tensor"][mine], list(scales))]
        planned = int((o["rows"][into_scales] * o["cols"][into_scales]).sum()) * plan.itemsize // 4
        if planned != scale_elements:  # the jobs must write exactly the scales the plan's scale ops would
            self.why = f"the fp8 ops cover {scale_elements} scales, the plan moves {planned}"
            return
        self.jobs = jobs
        self.rest = mine[~is8 & ~np.isin(o["src_tensor"][mine], list(scales))]


def check_engine_tensors(fp: Fp8Plan, dst: RankTensors) -> None:
    """Raise ExecutionError, listing every problem, unless each fp8 weight and float32 scale the FP8 destination
    declares is among the engine's tensors with its shape and dtype."""
    full = fp.full_dst
    problems = []
    for rank, given in dst.items():
        own = {n: d for (r, n), d in full.tensor_dtypes().items() if r == rank}
        for name, shape in full.rank_tensors(rank).items():
            if name not in own:
                continue
            t, dtype = given.get(name), torch_dtype(own[name])
            if t is None:
                kind = "scale" if "_scale_inv" in name else "fp8 weight"
                problems.append(f"destination rank {rank} has no {kind} {name!r} ({tuple(shape)} {dtype})")
            elif not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                problems.append(f"destination rank {rank} {name!r}: got {got}, the FP8 destination declares "
                                f"{tuple(shape)} {dtype} ({fp.scheme.block[0]}x{fp.scheme.block[1]} blocks)")
    if problems:
        raise ExecutionError("the engine's tensors do not match the FP8 destination:\n  - " +
                             "\n  - ".join(problems[:20]))


class Fp8Executor(Executor):
    """Runs an `Fp8Plan` with the executor called `inner` (module docstring).

    Args:
        src: source rank -> the trainer's tensors (the model's dtype).
        dst: destination rank -> the engine's tensors (fp8 weights, float32 `*weight_scale_inv`, the rest in the
            model's dtype).
        inner: the executor that moves the plan ("reference", "inprocess", "collective", "nixl", "shared").
        quantizer: "eager" (torch ops), "kernel" (Triton, one launch, a CUDA graph from the second refit) or
            "auto" (the kernel where every tensor is on a GPU and Triton is there).
        direct: with an in-process inner and every rank here, quantize straight into the engine's tensors
            (DirectQuantizer) where the plan allows ("auto"), always (True) or never (False).
        tuning: the kernel's launch settings (reshard.kernels.KernelTuning).
        **options: the inner executor's options.

    Raises:
        ExecutionError: not an Fp8Plan, engine tensors that do not match, or `direct=True` where it cannot be.
        ArgumentError: an unknown quantizer.
    """

    name = "fp8"

    def __init__(self, fp: Fp8Plan, binding: Any = None, process: int = 0, src: RankTensors | None = None,
                 dst: RankTensors | None = None, inner: str = "reference", quantizer: str = "auto",
                 direct: "bool | str" = "auto", tuning: "KernelTuning | None" = None, **options: Any) -> None:
        if not isinstance(fp, Fp8Plan):
            raise ExecutionError(f"the fp8 executor runs an Fp8Plan (reshard.planner.fp8.compile_fp8), not a "
                                 f"{type(fp).__name__}")
        if quantizer not in QUANTIZERS:
            raise ArgumentError("quantizer", quantizer, f"must be one of {QUANTIZERS}")
        self.fp = fp
        src, dst = dict(src or {}), dict(dst or {})
        tensors = [t for side in (src, dst) for ts in side.values() for t in ts.values()]
        self._device = single_cuda_device(tensors)
        if quantizer == "auto":
            quantizer = "kernel" if self._device is not None and triton_available() else "eager"
        self.quantizer = quantizer
        self.quantize: Any = {"eager": quantize_blocks, "kernel": "kernel"}[quantizer]
        check_engine_tensors(fp, dst)
        self.direct: DirectQuantizer | None = None
        in_process = inner in ("reference", "inprocess") and set(src) >= set(fp.plan.src_tensors.ranks)
        if direct and in_process:
            d = DirectQuantizer(fp, src, dst, tuning)
            if d.jobs is not None:
                self.direct = d
            elif direct is True:
                raise ExecutionError(f"this FP8 plan cannot be quantized straight into the destination: {d.why}")
        elif direct is True:
            raise ExecutionError("direct quantization needs every rank in this process (inner 'reference' or "
                                 "'inprocess')")
        self.senders = SenderQuantizer(fp, src, shadows=self.direct is None, tuning=tuning)
        self.receivers = ReceiverQuantizer(fp, dst, tuning)
        self._pins = Pins(tensors)  # checked where the direct jobs' views of them are bound
        name, options = ("inprocess", {"ops": self.direct.rest}) if self.direct is not None else (inner, options)
        self.inner = make_executor(name, fp.plan, binding, process, self.senders.tensors, self.receivers.tensors,
                                   **options)

    @property
    def src_tensors(self) -> Mapping[int, Mapping[str, torch.Tensor]]:
        """Source rank -> the tensors the inner executor reads: the trainer's, and the fp8 and scale shadows."""
        return self.senders.tensors

    def refit(self, version: int | None = None) -> RefitStats:
        start = time.perf_counter()
        if self.direct is not None:
            self._pins.check()
            out: list = []
            # the quantizer's jobs and the copies of everything else write disjoint places: side by side on a GPU
            on_streams([lambda: self.direct.run(self.quantize), lambda: out.append(self.inner.refit(version))],
                       self._device if self.quantize == "kernel" else None)
            self.receivers.run(self.quantize, direct=True)
            seconds = time.perf_counter() - start
            return replace(out[0], executor=self.name, seconds=seconds, phases={"quantize and copy": seconds})
        self.senders.run(self.quantize)
        marks = [("quantize", time.perf_counter())]
        stats = self.inner.refit(version)
        marks.append(("transfer", time.perf_counter()))
        self.receivers.run(self.quantize, direct=self.inner.name in ("reference", "inprocess"))
        marks.append(("land", time.perf_counter()))
        seconds, phases = phase_times(start, marks)
        return replace(stats, executor=self.name, seconds=seconds, phases=phases)

    def close(self) -> None:
        self.inner.close()


__all__ = ["AMAX_FLOOR", "DirectQuantizer", "Fp8Executor", "QUANTIZERS", "ReceiverQuantizer", "SenderQuantizer",
           "check_engine_tensors", "quantize_blocks"]
