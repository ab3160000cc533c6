"""The launch settings of the Triton kernels (reshard.kernels) as one immutable value, handed to a kernel's
constructor (and down from an executor's options) instead of module-level switches. Imports nothing heavy: the
executors name it without importing Triton."""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class KernelTuning:
    """How the kernels are launched; the defaults are the fastest of benchmarks/refit_inprocess.py's sweeps on an
    H200 (BENCHMARKS.md, Same host and FP8, issue 31), every setting giving the same bytes. Another device may
    prefer others: sweep them with `refit_inprocess.py --table-variants / --quantize-variants`.

    Attributes:
        copy_chunk_bytes: kernels.copy_table cuts each copy into chunks of at most this many bytes (one program
            each); 32-64 KiB ran the 30B-A3B refit at 89-92% of a device copy, 16 and 96 KiB at 87%.
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
