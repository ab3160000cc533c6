"""The Triton kernels (reshard.kernels) on CPU, through Triton's interpreter, byte for byte against the torch
references: the FP8 quantizer, all jobs in one launch (random shapes with partial blocks, strided views, zeros,
denormals, the largest bf16, fp8 rounding ties, inf and NaN; bf16, float16 and float32 in), whole quantizing refits
with it (straight into the engine, through the wire's shadows, with receivers quantizing; twice, the trainer's weights
changed in place between), the sum64 checksum (streams across the weights' period and past 2^32) and the table-copy
kernel (kernels.copy_table). The interpreter must be switched on before Triton is imported, so each check runs in
a fresh interpreter; the same checks run natively on the GPU (tests marked gpu)."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from harness import pythonpath
from reshard.kernels import KernelTuning

pytest.importorskip("triton")


def _interpreted(call: str) -> list[str]:
    code = f"import json; from harness import kernel_checks as k; print(json.dumps(k.{call}))"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=pythonpath())
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_fp8_quantizer_kernel_equals_reference():
    """All jobs in one launch (kernels.fp8_quantize); every edge-value kind in every input dtype."""
    assert _interpreted("check_fp8_table('cpu', cases=16)") == []


def test_quantizing_refits_with_the_kernel_equal_reference_checkpoint():
    assert _interpreted("check_fp8_refits('cpu', head_dim=32, layers=1)") == []


def test_sum64_and_copy_table_kernels_equal_references():
    """One interpreter for both (its start is most of the cost): sum64 against its reference, the table-copy
    kernel against torch's copies and the inprocess executor with it against the reference executor."""
    assert _interpreted("check_sum64('cpu', cases=4) + k.check_copy_table('cpu', cases=3, tps=((2, 1),))") == []


def test_copy_sum64_kernel_equals_copies_and_reference_digest():
    """The copy-and-checksum kernel: torch's copies and the "sum64" reference sums (several periods folded onto
    a window, the 16-bit lanes spilled), and the inprocess executor's checksum="sum64" through it against the reference
    executor and the reference digest."""
    assert _interpreted("check_copy_sum64('cpu', cases=6, tps=((2, 1),))") == []


def test_kernel_tuning_is_one_checked_immutable_value():
    """The kernels' launch settings: refused unless positive integers, never changed in place (no module state)."""
    assert KernelTuning().copy_chunk_bytes == 48 << 10
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="copy_warps"):
            KernelTuning(copy_warps=bad)
    with pytest.raises(dataclasses.FrozenInstanceError):
        KernelTuning().quantize_warps = 4
