"""Triton kernels for the executors' hot loops (copy_table, copy_sum64, sum64, fp8_quantize), imported lazily;
each is tested byte for byte against a torch reference. Launch settings: `KernelTuning` (no Triton needed)."""
from __future__ import annotations

from .tuning import KernelTuning


def triton_available() -> bool:
    """Whether Triton can be imported here (the kernels need it; executors fall back to torch ops without it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = ["KernelTuning", "triton_available"]
