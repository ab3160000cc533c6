"""GPU kernels (Triton) for the executors' hot loops: FP8 block quantization straight into its destination and
the "sum64" checksum. Imported lazily (Triton is not a dependency of `import reshard`); each has a torch reference
in the executors that it is tested byte for byte against (on CPU through Triton's interpreter, on GPUs natively)."""
from __future__ import annotations


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
