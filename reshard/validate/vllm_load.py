"""vLLM load parity, run from any interpreter: processes of a vLLM virtualenv (reshard.validate.vllm_side), one per
TP rank, each comparing vLLM's own `load_weights` of random HF weights with reshard's direct install of the
compiled HF -> vLLM plan, parameter by parameter, byte for byte. TP=1 and TP=2 run concurrently."""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from ..layouts import ModelSpec
from ..ports import free_port

ROOT = str(Path(__file__).resolve().parents[2])
WORLDS = (1, 2)


def start_vllm(python: str, args: list[str], world: int = 1,
               module: str = "reshard.validate.vllm_side") -> list[subprocess.Popen]:
    """`world` processes of `python -m MODULE ARGS` (default reshard.validate.vllm_side), one per rank (gloo over
    localhost)."""
    port, procs = free_port(), []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", VLLM_TARGET_DEVICE="cpu",
                   PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        procs.append(subprocess.Popen([python, "-m", module, *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def collect(procs: list[subprocess.Popen], deadline: float) -> list[Any]:
    """Each process's RESHARD_JSON payload; a failed or late one raises AssertionError with its last error line
    (the others are killed)."""
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


def vllm_load_parity(spec: ModelSpec, tiny: dict[str, Any], python: str, perturb: str | None = None,
                     worlds: tuple[int, ...] = WORLDS, dtype: str = "bfloat16", timeout_s: float = 900) -> str:
    """`dtype`: vLLM's model dtype (bfloat16, as served; float32 keeps every tensor in one dtype)."""
    with tempfile.TemporaryDirectory(prefix="reshard_vllm_load_") as tmp:
        config = Path(tmp, "config.json")
        config.write_text(json.dumps({**tiny, "torch_dtype": dtype}))
        args = [str(config), "--load-parity", "--dtype", dtype, *(["--perturb", perturb] if perturb else [])]
        running = {w: start_vllm(python, args, w) for w in worlds}
        deadline = time.monotonic() + timeout_s
        reports = {w: collect(procs, deadline) for w, procs in running.items()}
    refused = [f"{r['layout']} rank {r['rank']}: {r['error']}" for w in worlds for r in reports[w] if "error" in r]
    if refused:
        raise AssertionError(f"direct install refused ({dtype}): " + "; ".join(refused))
    bad = [f"{r['layout']} rank {r['rank']}: {', '.join(r['differ'])}"
           for w in worlds for r in reports[w] if r["differ"]]
    if bad:
        raise AssertionError(f"direct or loader install differs from vLLM's load_weights ({dtype}) in "
                             + "; ".join(bad))
    done = [f"{reports[w][0]['layout']}: {sum(r['params'] for r in reports[w])} parameters, "
            f"{sum(r['bytes'] for r in reports[w]) / 1e6:.2f} MB" for w in worlds]
    return (f"direct and loader installs byte-identical to vLLM's load_weights ({dtype}, random weights): "
            + "; ".join(done))
