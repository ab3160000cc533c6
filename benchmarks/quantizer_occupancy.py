"""The FP8 quantizer (kernels.fp8_quantize) compiled for a GPU without one, per warps setting: registers and spills
per thread as ptxas reports them, and what they allow per SM (programs, warps, bytes of the input in flight). A
bandwidth-bound kernel needs enough bytes in flight per SM; registers are what caps the number of programs. (The
variants this once compared -- a launch per job, strips of blocks, the float32 amax forms -- were removed in
55d766f; their figures stay in BENCHMARKS.md, FP8.) Needs only Triton (its bundled ptxas and cuobjdump); runs on a
CPU machine.

    python benchmarks/quantizer_occupancy.py [--arch 90] [--json out.json]

Launch-time specialisation is reproduced: pointers, sizes and row strides divisible by 16 (as every weight of
the refits measured in BENCHMARKS.md), which lets Triton vectorise loads and stores.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REGISTERS_PER_SM, MAX_WARPS_PER_SM, MAX_PROGRAMS_PER_SM = 65536, 64, 32  # Hopper (and Ampere) per SM
BLOCK = (128, 128)
ALIGNED = ("x_ptr", "q_ptr", "s_ptr", "n", "k", "sx", "sq", "x_base", "q_base", "s_base", "table")


def compiled(fn, signature: dict, constants: dict, warps: int, arch: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    given = dict(signature, **{name: "constexpr" for name in constants})
    sig = {name: given[name] for name in fn.arg_names}  # in the kernel's order: indices name the arguments
    names = list(sig)
    src = ASTSource(fn, sig, constexprs={(names.index(n),): v for n, v in constants.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED if n in names})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})


def resources(kernel) -> tuple[int, int]:
    """(registers per thread, spill bytes per thread) from the cubin."""
    import triton

    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "k.cubin")
        path.write_bytes(kernel.asm["cubin"])
        out = subprocess.run([str(tool), "--dump-resource-usage", str(path)], capture_output=True, text=True,
                             check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    if m is None:
        raise RuntimeError(f"cuobjdump printed no resource usage: {out[-300:]}")
    return int(m.group(1)), int(m.group(2))


def per_sm(registers: int, warps: int) -> int:
    """Programs of `warps` warps one SM holds at once, as registers (allocated per warp in units of 256) allow."""
    per_warp = -(-registers * 32 // 256) * 256
    return max(0, min(REGISTERS_PER_SM // (per_warp * warps), MAX_WARPS_PER_SM // warps, MAX_PROGRAMS_PER_SM))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100 / H200)")
    ap.add_argument("--json")
    args = ap.parse_args()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    from reshard.kernels import fp8_quantize as fq

    constants = dict(BN=BLOCK[0], BK=BLOCK[1], FLOOR=fq.AMAX_FLOOR, FMAX=fq.FP8_MAX, EXACT_CAST=False, XALIGN=8,
                     QALIGN=16)
    signature = {"x_base": "*bf16", "q_base": "*u8", "s_base": "*fp32", "table": "*i64"}
    label, amax = "all jobs in one launch (table)", "input bits"

    block_bytes = BLOCK[0] * BLOCK[1] * 2
    rows = []
    print(f"{'kernel (bf16 in, 128x128 blocks)':34s} {'amax':>12s} {'warps':>5s} {'regs':>5s} {'spill B':>7s} "
          f"{'programs/SM':>11s} {'warps/SM':>8s} {'KiB in flight/SM':>16s}")
    for warps in (2, 4, 8, 16, 32):
        regs, spill = resources(compiled(fq._quantize_table_kernel, signature, constants, warps, args.arch))
        programs = per_sm(regs, warps)
        row = {"kernel": label, "amax": amax, "warps": warps, "registers": regs, "spill_bytes": spill,
               "programs_per_sm": programs, "warps_per_sm": programs * warps,
               "kib_in_flight_per_sm": int(programs * block_bytes) // 1024}
        rows.append(row)
        print(f"{label:34s} {amax:>12s} {warps:5d} {regs:5d} {spill:7d} "
              f"{programs:11d} {row['warps_per_sm']:8d} {row['kib_in_flight_per_sm']:16d}", flush=True)
    if args.json:
        import triton

        Path(args.json).write_text(json.dumps({"arch": args.arch, "triton": triton.__version__, "rows": rows},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
