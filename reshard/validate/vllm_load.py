"""The vLLM stages from any interpreter: processes of a vLLM virtualenv (reshard.validate.vllm_side), one per TP
rank, one launch per TP size checking any number of configs in turn."""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from ..ports import free_port

ROOT = str(Path(__file__).resolve().parents[2])
WORLDS = (1, 2)


def start_vllm(python: str, args: list[str], world: int = 1,
               module: str = "reshard.validate.vllm_side") -> list[subprocess.Popen]:
    """`world` processes of `python -m MODULE ARGS`, one per rank (gloo over localhost)."""
    port, procs = free_port(), []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", VLLM_TARGET_DEVICE="cpu",
                   PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        procs.append(subprocess.Popen([python, "-m", module, *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def collect(procs: list[subprocess.Popen], deadline: float) -> list[Any]:
    """Each process's RESHARD_JSON payload.

    Raises:
        AssertionError: a process failed or was late (its last error line; the others are killed).
    """
    out = []
    try:
        for rank, p in enumerate(procs):
            try:
                stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"vLLM rank {rank} did not finish in time") from None
            lines = [ln for ln in stdout.splitlines() if ln.startswith("RESHARD_JSON ")]
            if p.returncode != 0 or not lines:
                tail = [ln for ln in stderr.strip().splitlines() if ln.strip()][-1:]
                raise AssertionError(f"vLLM rank {rank} failed (exit {p.returncode}): {tail}")
            out.append(json.loads(lines[-1][len("RESHARD_JSON "):]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


def side_reports(tinies: list[dict[str, Any]], python: str, *args: str, worlds: tuple[int, ...] = (1,),
                 dtype: str = "bfloat16", timeout_s: float = 900) -> list[dict[int, list[Any]]]:
    """reshard.validate.vllm_side ARGS on each tiny config (in `dtype`), one launch per TP size in `worlds`,
    concurrently. Returns, per config, TP size -> its ranks' entries."""
    with tempfile.TemporaryDirectory(prefix="reshard_vllm_") as tmp:
        paths = [str(Path(tmp, f"config{i}.json")) for i in range(len(tinies))]
        for path, tiny in zip(paths, tinies):
            Path(path).write_text(json.dumps({**tiny, "torch_dtype": dtype}))
        running = {w: start_vllm(python, [*paths, *args], w) for w in worlds}
        deadline = time.monotonic() + timeout_s * len(tinies)
        out = {w: collect(procs, deadline) for w, procs in running.items()}
    return [{w: [ranks[i] for ranks in out[w]] for w in worlds} for i in range(len(tinies))]


def load_parity_reports(tinies: list[dict[str, Any]], python: str, perturb: dict[int, str] | None = None,
                        worlds: tuple[int, ...] = WORLDS, dtype: str = "bfloat16") -> list[dict[int, list[Any]]]:
    """vllm_side.load_parity's reports per config and TP size (side_reports). `perturb`: config index -> canonical
    tensor corrupted on reshard's side."""
    return side_reports(tinies, python, "--load-parity", "--dtype", dtype,
                        *(f"--perturb={i}={name}" for i, name in (perturb or {}).items()), worlds=worlds, dtype=dtype)


def load_parity_summary(reports: dict[int, list[dict[str, Any]]], dtype: str = "bfloat16") -> str:
    """One config's verdict from its load_parity_reports: the line the stage prints.

    Raises:
        AssertionError: a direct install refused the declared layout, or an install's bytes differ from vLLM's
            load_weights (naming the layout, rank and parameters).
    """
    refused = [f"{r['layout']} rank {r['rank']}: {r['error']}" for ranks in reports.values() for r in ranks
               if "error" in r]
    if refused:
        raise AssertionError(f"direct install refused ({dtype}): " + "; ".join(refused))
    bad = [f"{r['layout']} rank {r['rank']}: {', '.join(r['differ'])}"
           for ranks in reports.values() for r in ranks if r["differ"]]
    if bad:
        raise AssertionError(f"direct or loader install differs from vLLM's load_weights ({dtype}) in "
                             + "; ".join(bad))
    done = [f"{ranks[0]['layout']}: {sum(r['params'] for r in ranks)} parameters, "
            f"{sum(r['bytes'] for r in ranks) / 1e6:.2f} MB" for ranks in reports.values()]
    return (f"direct and loader installs byte-identical to vLLM's load_weights ({dtype}, random weights): "
            + "; ".join(done))
