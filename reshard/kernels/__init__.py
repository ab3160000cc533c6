"""GPU kernels (Triton) for the executors' hot loops: many copies as one launch (copy_table), copies with their
"sum64" checksum (copy_sum64), the checksum alone (sum64) and FP8 block quantization straight into its destination
(fp8_quantize). Imported lazily (Triton is not a dependency of `import reshard`); each has a torch reference in the
executors that it is tested byte for byte against (on CPU through Triton's interpreter, on GPUs natively). Their
launch settings are one value, `KernelTuning` (importable without Triton)."""
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
