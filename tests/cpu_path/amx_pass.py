"""Which tests to run again with the AMX path forced, from the consult log of a run on the vector path.

    python tests/cpu_path/amx_pass.py LOG     prints "run TEST" and "not-exercisable TEST" lines (pytest node ids)

A test runs again when some process of it consulted the AMX checks (torch.cpu's amx_tile / amx_fp16: consults of
the AVX-512 checks alone, which vLLM makes while building any model, do not choose an AMX kernel) and could take
the AMX path here: the CUDA wheel of vLLM anywhere (stand-in packing kernel), the vLLM CPU build only on a CPU with
AMX. A test whose consults all came from processes that cannot (the CPU build on a CPU without AMX) is named as not
exercisable. The AMX run then keeps an each-choice cover of these tests' parametrizations (cpu_path_session.py).
Reads the JSON lines cpu_path_pin.py writes; plain standard library, so any of the suite's pythons can run it.
"""
from __future__ import annotations

import json
import sys


AMX_CHECKS = ("_is_amx_tile_supported", "_is_amx_fp16_supported")


def plan(log_path: str) -> tuple[list[str], list[str]]:
    forcible: dict[str, bool] = {}
    with open(log_path) as f:
        for line in f:
            if not line.strip():
                continue
            e = json.loads(line)
            test = e["test"]
            if not test or e["check"] not in AMX_CHECKS:
                continue
            can = e["cpu_has_it"] or not e["native_kernels"]
            forcible[test] = forcible.get(test, False) or can
    return sorted(m for m, c in forcible.items() if c), sorted(m for m, c in forcible.items() if not c)


if __name__ == "__main__":
    try:
        run, cannot = plan(sys.argv[1])
    except FileNotFoundError:
        run, cannot = [], []
    for test in run:
        print("run", test)
    for test in cannot:
        print("not-exercisable", test)
