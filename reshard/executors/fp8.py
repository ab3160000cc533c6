"""Quantizing refits run by any executor: senders quantize before the plan moves bytes, receivers after.

Numerics (`quantize_blocks`), per block of `block` = (rows, cols), as DeepGEMM's / vLLM's `per_block_cast_to_fp8`
defines FP8 block checkpoints: amax = max |x| over the block in float32, at least 1e-4; scale = amax / 448;
q = float8_e4m3fn(x * (1 / scale)) with torch's cast (round to nearest even). The stored `weight_scale_inv` is
`scale` (what dequantization multiplies by). Partial blocks at a tensor's edge take the amax of what they hold.

`Fp8Executor` wraps the executor a plan would use (`make_executor(name, ...)`) around an `Fp8Plan`:
  1. construction: the source tensors of this process become the wire's (fp8 and scale shadows, allocated once,
     beside the trainer's tensors), the destination tensors the plan's (the engine's fp8 weights and scales;
     staging buffers for tensors quantized on receivers); the inner executor is bound to those;
  2. `refit()`: each source rank quantizes the pieces the plan reads from it into its shadows; the inner
     executor moves the plan (staged by default: fp8 weights and their scales commit together or not at all);
     then each destination rank quantizes its staging tensors into temporaries and only then writes weights and
     scales (a failure before that point leaves both unchanged);
  3. `close()` closes the inner executor.
"""
from __future__ import annotations

import functools
from typing import Any, Mapping

import torch

from ..errors import ExecutionError
from ..layouts.fp8 import FP8_MAX, STAGING, scale_name
from ..planner.fp8 import Fp8Plan
from .base import Executor, RankTensors, make_executor
from .local import _box, element_shape, torch_dtype

AMAX_FLOOR = 1e-4  # DeepGEMM's / vLLM's floor on a block's amax: an all-zero block gets scale 1e-4 / 448


def _block_amax(v: torch.Tensor) -> torch.Tensor:
    """max |x| per block of a [nb, bn, kb, bk] view, in float32: the larger of -min and max (exact, and no |x|
    temporary)."""
    return torch.maximum(v.amax(dim=(1, 3)), v.amin(dim=(1, 3)).neg()).float()


def _scale_cast(v: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn(x * inv) per block: float32 products, then the cast."""
    return torch.mul(v, inv).to(torch.float8_e4m3fn)


def quantize_blocks(x: torch.Tensor, block: tuple[int, int], out: torch.Tensor | None = None, *,
                    fused: "tuple | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [n, k], float32 scales [ceil(n/bn), ceil(k/bk)]) of a 2-D tensor (see the module doc); the fp8 values
    are written into `out` (any strided [n, k] float8 view) when given. `fused`: compiled (amax, scale_cast)
    kernels to use instead of eager ones (`compiled_quantizer`)."""
    n, k = x.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    if (n, k) != (nb * bn, kb * bk):  # pad with zeros: they never raise an amax
        padded = torch.zeros((nb * bn, kb * bk), dtype=x.dtype, device=x.device)
        padded[:n, :k] = x
        x = padded
    v = x.reshape(nb, bn, kb, bk)
    amax = (fused[0] if fused else _block_amax)(v).clamp_(min=AMAX_FLOOR)
    # the scale's division and reciprocal stay eager, on tensors: CUDA divides by a Python scalar as a product
    # with its reciprocal, which can differ from amax / 448 in the last bit (the GPU test found it)
    scale = amax / torch.full_like(amax, FP8_MAX)
    inv = torch.reciprocal(scale)[:, None, :, None]
    if fused:
        q = fused[1](v, inv).reshape(nb * bn, kb * bk)[:n, :k]
    else:
        q = torch.mul(v, inv).reshape(nb * bn, kb * bk)[:n, :k]  # float32: cast on the way into `out`
    if out is None:
        return q.to(torch.float8_e4m3fn), scale
    out.copy_(q)
    return out, scale


_COMPILED: dict[str, object] = {}


def compiled_quantizer():
    """`quantize_blocks` with its two large passes (block amax; scale and cast) through torch.compile: one fused
    kernel each on GPUs. The GPU test holds its bytes equal to the reference's."""
    if "fn" not in _COMPILED:
        fused = (torch.compile(_block_amax, dynamic=False), torch.compile(_scale_cast, dynamic=False))
        _COMPILED["fn"] = functools.partial(quantize_blocks, fused=fused)
    return _COMPILED["fn"]


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 values of fp8 blocks (q * scale per block): what the engine computes with."""
    bn, bk = block
    s = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:q.shape[0], :q.shape[1]]
    return q.float() * s


def _as_2d(view: torch.Tensor) -> torch.Tensor:
    return view.reshape(-1, view.shape[-1]) if view.dim() != 2 else view


def _tiles(t: torch.Tensor, pieces: list, block: tuple[int, int]) -> bool:
    """Whether 2-D `pieces` cover the 2-D tensor `t` exactly in whole blocks: then quantizing `t` at once gives
    every piece's blocks (a block never spans two pieces) and the scale tensor is `t`'s block grid."""
    if t.dim() != 2 or any(len(p.lengths) != 2 for p in pieces):
        return False
    if sum(p.lengths[0] * p.lengths[1] for p in pieces) != t.numel():
        return False  # pieces of one rank never overlap (the compiler proves it), so equal counts tile t
    return all(o % b == 0 and n % b == 0 for p in pieces for o, n, b in zip(p.phys_offset, p.lengths, block))


class SenderQuantizer:
    """The wire's source tensors of this process's source ranks, and the quantization that fills them."""

    def __init__(self, fp: Fp8Plan, src: RankTensors) -> None:
        plan, layout = fp.plan, fp.plan.src
        block = fp.scheme.block
        own = plan.src_tensors.own_dtypes()
        unit = torch_dtype(plan.src.dtype)
        self.tensors: dict[int, dict[str, torch.Tensor]] = {}
        self.jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (bf16 piece, fp8 piece, scale piece)
        for rank, given in src.items():
            wanted = plan.src_tensors.on_rank(rank)
            out: dict[str, torch.Tensor] = {}
            for name, units in wanted.items():
                dtype = torch_dtype(own[(rank, name)]) if (rank, name) in own else unit
                shape = element_shape(units, unit, dtype)
                real = given.get(name)
                if dtype != torch.float8_e4m3fn:  # the trainer's own tensor (a float32 router bias too)
                    if real is not None:
                        out[name] = real
                    continue  # a scale: no trainer tensor (below)
                if real is None:
                    continue
                if real.dtype != unit or tuple(real.shape) != tuple(shape):
                    raise ExecutionError(f"source rank {rank} {name!r}: got {tuple(real.shape)} {real.dtype}, a "
                                         f"quantizing refit reads {tuple(shape)} {unit} (a source already in "
                                         f"{real.dtype} is not re-quantized into other blocks)")
                # a shadow beside the trainer's tensor, on its device (fp8 weight or float32 scale)
                out[name] = torch.zeros(shape, dtype=dtype, device=real.device)
            for name, units in wanted.items():  # scales have no trainer tensor: shadows on the weight's device
                if name not in given and (rank, name) in own:
                    dev = next((t.device for t in given.values() if isinstance(t, torch.Tensor)), "cpu")
                    out[name] = torch.zeros(element_shape(units, unit, torch_dtype(own[(rank, name)])),
                                            dtype=torch_dtype(own[(rank, name)]), device=dev)
            self.tensors[rank] = out
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
                    self.jobs.append((_as_2d(_box(given[wname], a.phys_offset, a.lengths)),
                                      _as_2d(_box(out[wname], a.phys_offset, a.lengths)),
                                      _as_2d(_box(out[sname], b.phys_offset, b.lengths))))
        self.block = block

    def run(self, quantize=None) -> None:
        quantize = quantize or quantize_blocks
        with torch.no_grad():
            for x, q, s in self.jobs:
                _, ss = quantize(x, self.block, q)  # fp8 straight into the shadow
                s.copy_(ss)


class ReceiverQuantizer:
    """This process's destination ranks: staging buffers for receiver-quantized tensors, and the quantization
    from them into the engine's fp8 weights and scales."""

    def __init__(self, fp: Fp8Plan, dst: RankTensors) -> None:
        plan, layout, full = fp.plan, fp.plan.dst, fp.full_dst
        own = plan.dst_tensors.own_dtypes()
        unit = torch_dtype(plan.dst.dtype)
        self.tensors: dict[int, dict[str, torch.Tensor]] = {}
        self.jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (staging, fp8 weight, scale)
        for rank, given in dst.items():
            out = {}
            for name, units in plan.dst_tensors.on_rank(rank).items():
                wanted = torch_dtype(own[(rank, name)]) if (rank, name) in own else unit
                real = given.get(name[:-len(STAGING)] if name.endswith(STAGING) else name)
                if name.endswith(STAGING) or (real is not None and real.dtype == torch.float8_e4m3fn and
                                              wanted == unit):
                    # staging: vLLM names it after its parameter; an HF destination's is the fp8 tensor's name
                    out[name] = torch.zeros(units, dtype=unit, device=real.device if real is not None else "cpu")
                elif real is not None:
                    out[name] = real
            self.tensors[rank] = dict(given, **out)
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
                    self.jobs.append((_as_2d(_box(self.tensors[rank][a.tensor], a.phys_offset, a.lengths)),
                                      _as_2d(_box(given[b.tensor], b.phys_offset, b.lengths)),
                                      _as_2d(_box(given[c.tensor], c.phys_offset, c.lengths))))
        self.block = fp.scheme.block

    def run(self, quantize=None) -> None:
        """All quantized first, then written: weights and scales change together or not at all."""
        quantize = quantize or quantize_blocks
        with torch.no_grad():
            done = [quantize(x, self.block) for x, _, _ in self.jobs]
            for (_, q, s), (qq, ss) in zip(self.jobs, done):
                q.copy_(qq)
                s.copy_(ss)


def check_engine_tensors(fp: Fp8Plan, dst: RankTensors) -> None:
    """Every fp8 weight and float32 scale the FP8 destination declares is among the engine's tensors, with its
    shape and dtype; all problems at once, before anything is quantized or moved."""
    full = fp.full_dst
    problems = []
    for rank, given in dst.items():
        own = {n: d for (r, n), d in full.tensor_dtypes().items() if r == rank}
        for name, shape in full.rank_tensors(rank).items():
            if name not in own:
                continue
            t, dtype = given.get(name), torch_dtype(own[name])
            if t is None:
                kind = "scale" if name.endswith("_scale_inv") or "_scale_inv" in name else "fp8 weight"
                problems.append(f"destination rank {rank} has no {kind} {name!r} ({tuple(shape)} {dtype})")
            elif not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                problems.append(f"destination rank {rank} {name!r}: got {got}, the FP8 destination declares "
                                f"{tuple(shape)} {dtype} ({fp.scheme.block[0]}x{fp.scheme.block[1]} blocks)")
    if problems:
        raise ExecutionError("the engine's tensors do not match the FP8 destination:\n  - " +
                             "\n  - ".join(problems[:20]))


class Fp8Executor(Executor):
    """Runs an `Fp8Plan` with the executor called `inner` (local, distributed, nixl, shared): see the module doc.
    `src`: source rank -> the trainer's tensors (the model's dtype); `dst`: destination rank -> the engine's
    tensors (fp8 weights, float32 `*weight_scale_inv`, the rest in the model's dtype). `compiled`: quantize through
    torch.compile (on GPUs: fused kernels)."""

    name = "fp8"

    def __init__(self, fp: Fp8Plan, binding: Any = None, process: int = 0, src: RankTensors | None = None,
                 dst: RankTensors | None = None, inner: str = "local", compiled: bool = False,
                 **options: Any) -> None:
        if not isinstance(fp, Fp8Plan):
            raise ExecutionError(f"the fp8 executor runs an Fp8Plan (reshard.planner.fp8.compile_fp8), not a "
                                 f"{type(fp).__name__}")
        self.fp = fp
        self.quantize = compiled_quantizer() if compiled else quantize_blocks
        check_engine_tensors(fp, dict(dst or {}))
        self.senders = SenderQuantizer(fp, dict(src or {}))
        self.receivers = ReceiverQuantizer(fp, dict(dst or {}))
        self.inner = make_executor(inner, fp.plan, binding, process, self.senders.tensors, self.receivers.tensors,
                                   **options)

    @property
    def src_tensors(self) -> Mapping[int, Mapping[str, torch.Tensor]]:
        return self.senders.tensors

    def refit(self, version: int | None = None) -> Any:
        self.senders.run(self.quantize)
        stats = self.inner.refit(version) if version is not None else self.inner.refit()
        self.receivers.run(self.quantize)
        return stats

    def close(self) -> None:
        self.inner.close()


def execute_fp8_local(fp: Fp8Plan, src: RankTensors, dst: RankTensors) -> None:
    """One quantizing refit with every rank in this process."""
    Fp8Executor(fp, None, 0, src, dst, inner="local").refit()


__all__ = ["AMAX_FLOOR", "Fp8Executor", "ReceiverQuantizer", "SenderQuantizer", "check_engine_tensors",
           "compiled_quantizer", "dequantize_blocks", "execute_fp8_local", "quantize_blocks"]
