"""Run a function on N fresh processes joined in one world (gloo, or NCCL with one GPU per process), without
pickle: the job is JSON.

    results = run_world(3, "reshard.testing.refit_jobs:run_cases", {"cases": [...]}, workdir, timeout=60)

Each process runs `python -m reshard.testing.world JOB RANK`, joins the world through a FileStore in `workdir`,
calls `function(rank, world_size, args)` and writes what it returns (JSON) to `workdir/result-RANK.json`. A
process that dies or outlives `timeout` gets `None` as its result (the ones still running are killed).
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any


def run_world(size: int, function: str, args: dict[str, Any], workdir: str | Path, timeout: float = 120.0,
              pg_timeout: float = 60.0, backend: str = "gloo") -> list[Any]:
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    for stale in [*workdir.glob("result-*.json"), workdir / "store"]:
        stale.unlink(missing_ok=True)  # a FileStore must start empty
    job = workdir / "job.json"
    job.write_text(json.dumps({"size": size, "function": function, "args": args, "pg_timeout": pg_timeout,
                               "backend": backend,
                               "store": str(workdir / "store")}))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "reshard.testing.world", str(job), str(r)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(size)]
    deadline = time.monotonic() + timeout
    logs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()  # only processes started here, by their handle
            out, _ = p.communicate()
        logs.append(out)
    results = []
    for r in range(size):
        f = workdir / f"result-{r}.json"
        results.append(json.loads(f.read_text()) if f.exists() else None)
    (workdir / "logs.txt").write_text("\n".join(f"--- rank {r}\n{log}" for r, log in enumerate(logs)))
    return results


def _main(job_path: str, rank: int) -> None:
    import torch.distributed as dist

    job = json.loads(Path(job_path).read_text())
    backend, device = job.get("backend", "gloo"), None
    if backend == "nccl":  # one GPU per process, bound at start-up (communicators made eagerly)
        import torch

        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
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
