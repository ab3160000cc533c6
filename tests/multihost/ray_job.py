"""The driver of the Ray test across two hosts (tests/multihost/test_ray_multihost.py), run on host A of the test
bed: `python ray_job.py JOB.json`. It joins the cluster (head on A, worker node on B), starts a vLLM engine actor on
host B (the vLLM CPU virtualenv's python, placed by the "host_b" resource) from checkpoint B and megatron-core TP 2
trainer actors on host A ("host_a") loaded with checkpoint A; the trainers refit the engine (A's weights), take the
training step and refit again (B's weights). Writes what it saw, as JSON, to JOB.out.json.
"""
from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def main(path: str) -> None:
    job = json.loads(Path(path).read_text())
    out: dict[str, Any] = {}
    engine = None
    try:
        import ray

        from reshard.adapters.ray import RayEngineClient
        from harness.ray_jobs import open_group, refit_all, start_engine, start_trainers, stop_engine

        ray.init(address=job["address"], log_to_driver=False)
        t0 = time.monotonic()
        engine = start_engine(job["b"], 1, resources={"host_b": 1})
        client = RayEngineClient(engine, "engine on host B", timeout=600.0)
        out["fresh"] = client.greedy(job["prompts"])  # started on checkpoint B: the ground truth
        out["engine_start_s"] = time.monotonic() - t0
        out["engine_node"] = ray.get(engine.node_address.remote(), timeout=60)
        trainers = start_trainers(2, {"tp": 2, "checkpoint": job["a"]}, resources={"host_a": 1})
        out["trainer_nodes"] = ray.get([t.node_address.remote() for t in trainers], timeout=600)
        group = {"name": "b", "dst": {"tp": 1}, "transport": job["transport"], "timeout": 300,
                 "options": {"timeout": 120}}
        t0 = time.monotonic()
        out["opened"] = open_group(trainers, group, [engine])
        out["init_s"] = time.monotonic() - t0
        out["refits"] = []
        for step in range(2):
            if step:
                ray.get([t.train_step.remote(step) for t in trainers])
            results = refit_all(trainers, f"step-{step}")
            out["refits"].append({"results": results, "tokens": client.greedy(job["prompts"]),
                                  "version": client.weight_version(), "landed": client.landed()})
            if not all(r["b"]["ok"] for r in results):
                break
    except BaseException as e:  # noqa: BLE001 - the test reads what failed
        out["error"] = f"{type(e).__name__}: {e}"
        out["trace"] = traceback.format_exc()[-4000:]
    finally:
        if engine is not None:
            try:
                stop_engine(engine)
            except Exception as e:  # noqa: BLE001 - reported; the cluster's nodes are ended by the test
                out["stop_error"] = str(e)
    Path(path).with_suffix(".out.json").write_text(json.dumps(out, default=str))
    sys.stdout.flush()
    import os

    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
