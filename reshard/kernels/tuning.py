"""The Triton kernels' launch settings as one immutable value (importable without Triton)."""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class KernelTuning:
    """How the kernels are launched (every setting gives the same bytes); the defaults are the fastest of
    benchmarks/refit_inprocess.py's sweeps on an H200 (BENCHMARKS.md, Same host and FP8).

    Attributes:
        copy_chunk_bytes: kernels.copy_table cuts each copy into chunks of at most this many bytes.
        copy_block_bytes: bytes a copy_table program moves per load (two blocks in flight before the first store).
        copy_warps: warps per copy_table program.
        sum64_window_bytes: kernels.copy_sum64's window of the checksum period per program (a multiple of 16
            dividing 2^23).
        sum64_warps: warps per copy_sum64 program.
        quantize_warps: warps per program of the FP8 quantizer (kernels.fp8_quantize, one block each).

    Raises:
        ValueError: a setting is not a positive integer.
    """

    copy_chunk_bytes: int = 48 << 10
    copy_block_bytes: int = 16 << 10
    copy_warps: int = 16
    sum64_window_bytes: int = 32 << 10
    sum64_warps: int = 16
    quantize_warps: int = 8

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KernelTuning.{f.name} must be a positive integer, not {value!r}")


__all__ = ["KernelTuning"]
