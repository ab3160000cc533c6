"""Run a function on N fresh processes joined in one world (gloo, or NCCL with one GPU per process), without
pickle: the job is JSON.

    results = run_world(3, "mypackage.jobs:check", {"cases": [...]}, workdir, timeout=60)

Each process (`python -m reshard.testing.world JOB RANK`) joins through a FileStore in `workdir`, calls
`function(rank, world_size, args)` and writes its JSON result; one that dies or outlives `timeout` gets None.

Across hosts, `launch` starts each rank where the test wants it and `interfaces[r]` names the interface rank r's
harness gloo device binds; GLOO_SOCKET_IFNAME is set only while the harness world and its groups are made, so
reshard's own groups find their addresses unaided. With more ranks than GPUs, each rank is a host of its own to
NCCL (NCCL_HOSTID), joined over loopback (a variable already set is kept).
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

Launch = Callable[[int, list[str], dict[str, str]], subprocess.Popen]
"""`launch(rank, argv, env)`: rank's process, `env` added to its environment, stdout (with stderr) piped as text."""

_IFNAME = "GLOO_SOCKET_IFNAME"
_harness_interface: str | None = None  # this process's harness device (set by _main)


def run_world(size: int, function: str, args: dict[str, Any], workdir: str | Path, timeout: float = 120.0,
              pg_timeout: float = 60.0, backend: str = "gloo", launch: Launch | None = None,
              interfaces: Sequence[str | None] | None = None, python: str | None = None,
              env: dict[str, str] | None = None) -> list[Any]:
    """Run `function` ("module:name") on `size` processes joined in one world; their JSON results, in rank order.

    Args:
        size: the number of processes (ranks).
        function: "module:name" of `function(rank, world_size, args) -> JSON-able`.
        args: the JSON-able arguments every rank gets.
        workdir: where the job, the FileStore, the results and `logs.txt` (every rank's output) go.
        timeout: seconds for the whole world; ranks still running then are killed.
        pg_timeout: the harness world's collective timeout, in seconds.
        backend: "gloo", or "nccl" (one GPU per rank).
        launch: how each rank is started (None: a child process on this host).
        interfaces: per rank, the interface the harness gloo device binds (None: gloo's default, the host name).
        python: the ranks' interpreter (None: this one).
        env: variables added to every rank's environment.

    Returns:
        Each rank's result, None for a rank that died or ran out of time.

    Raises:
        ValueError: `interfaces` not one entry per rank.
    """
    if interfaces is not None and len(interfaces) != size:
        raise ValueError(f"interfaces must name one entry per rank ({size}), got {len(interfaces)}")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    for stale in [*workdir.glob("result-*.json"), workdir / "store"]:
        stale.unlink(missing_ok=True)  # a FileStore must start empty
    job = workdir / "job.json"
    job.write_text(json.dumps({"size": size, "function": function, "args": args, "pg_timeout": pg_timeout,
                               "backend": backend, "interfaces": list(interfaces or [None] * size),
                               "store": str(workdir / "store")}))
    start = launch or _launch_here
    procs = [start(r, [python or sys.executable, "-m", "reshard.testing.world", str(job), str(r)],
                   {"OMP_NUM_THREADS": "1", **(env or {})}) for r in range(size)]
    deadline = time.monotonic() + timeout
    logs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()  # only processes started here, by their handle
            out, _ = p.communicate()
        logs.append(out or "")
    files = [workdir / f"result-{r}.json" for r in range(size)]
    results = [json.loads(f.read_text()) if f.exists() else None for f in files]
    (workdir / "logs.txt").write_text("\n".join(f"--- rank {r}\n{log}" for r, log in enumerate(logs)))
    return results


def _launch_here(rank: int, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


@contextlib.contextmanager
def _harness_device() -> Iterator[None]:
    """GLOO_SOCKET_IFNAME set to this rank's harness interface for the duration (reshard's groups must not
    inherit it)."""
    if _harness_interface is None:
        yield
        return
    before = os.environ.get(_IFNAME)
    os.environ[_IFNAME] = _harness_interface
    try:
        yield
    finally:
        if before is None:
            del os.environ[_IFNAME]
        else:
            os.environ[_IFNAME] = before


def new_group(ranks: list[int]) -> Any:
    """A subgroup of `ranks` of the harness world, on the harness's device (every rank must call it).

    Returns:
        The process group (as torch.distributed.new_group returns it).

    Raises:
        RuntimeError: from torch.distributed, when the group cannot be made.
    """
    import torch.distributed as dist

    with _harness_device():
        return dist.new_group(ranks)


def _main(job_path: str, rank: int) -> None:
    import torch
    import torch.distributed as dist

    global _harness_interface
    job = json.loads(Path(job_path).read_text())
    _harness_interface = (job.get("interfaces") or [None] * job["size"])[rank]
    backend, device = job.get("backend", "gloo"), None
    if 0 < torch.cuda.device_count() < job["size"]:  # ranks share GPUs: each a host of its own to NCCL, over lo
        os.environ.setdefault("NCCL_HOSTID", f"reshard-world-rank{rank}")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    if backend == "nccl":  # one GPU per process, bound at start-up (communicators made eagerly)
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    with _harness_device():
        dist.init_process_group(backend, init_method=f"file://{job['store']}", rank=rank, world_size=job["size"],
                                timeout=timedelta(seconds=job["pg_timeout"]), device_id=device)
    module, name = job["function"].split(":")
    result = getattr(importlib.import_module(module), name)(rank, job["size"], job["args"])
    out = Path(job_path).parent / f"result-{rank}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(out)
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown, which can block when a peer is gone


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]))
