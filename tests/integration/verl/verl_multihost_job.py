"""The driver of tests/integration/verl/test_verl_multihost.py, run on host A of the two-host test bed (the pytest
process cannot reach the namespaces' addresses): `python verl_multihost_job.py JOB.json`.

It joins the Ray cluster at the job's address, starts verl's real CheckpointEngineManager over 2 trainer workers
placed on host A and 3 rollout workers placed on host B (harness.verl_cpu.Refit, custom resources "host_a"
and "host_b"), with no `host` in the backend's config, and refits as the job says. What happened goes, as JSON, to
JOB.out.json: where every worker ran, each refit's seconds (and its whole step's: the reconfiguration and
training step before it, the calls to the workers after it) and the workers' shutdown's, the trainer's HF tensor digests (the ground truth) and
what every rollout worker serves, and the error and seconds of a refit that failed.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    out_path = Path(job_path).with_suffix(".out.json")
    out: dict = {"refits": []}
    try:
        from harness import verl_cpu as vc

        vc.start_ray(address=job["address"])
        base = vc.checkpoint_engine_config(job["checkpoint"], 1, **job.get("options", {}))
        assert "host" not in base["engine_kwargs"]["reshard"]
        refit = vc.Refit(2, 3, job["checkpoint"], base, trainer_node="host_a", rollout_node="host_b")
        out["trainers"], out["rollouts"] = refit.trainers.where(), refit.rollouts.where()
        for step in job["steps"]:
            begin = time.monotonic()  # the whole step: a worker still busy with an earlier refit delays its calls
            if step.get("options") is not None:  # every worker's engine anew from this config (same backend)
                refit.reconfigure(vc.checkpoint_engine_config(job["checkpoint"], 1, **step["options"]))
            refit.trainers.train_step(step["step"])
            record: dict = {"step": step["step"], "options": step.get("options")}
            start = time.monotonic()
            try:
                record["metrics"] = refit.refit(step["step"])
            except Exception as e:  # noqa: BLE001 - the test reads what failed and how fast
                record["error"] = f"{type(e).__name__}: {e}"
            record["seconds"] = time.monotonic() - start
            record["expected"] = refit.expected()  # calls the trainer workers: one still busy with the refit waits
            record["served"] = refit.served()
            record["trainers"] = refit.trainers.where()
            record["step_seconds"] = time.monotonic() - begin
            out["refits"].append(record)
            Path(out_path).write_text(json.dumps(out))  # so far, in case a later step hangs
        start = time.monotonic()
        refit.shutdown()  # ray.kill of every worker, their placement groups removed
        out["shutdown_seconds"] = time.monotonic() - start
    except BaseException as e:  # noqa: BLE001 - the test reads what failed
        out["error"] = f"{type(e).__name__}: {e}"
        out["trace"] = traceback.format_exc()[-4000:]
    out_path.write_text(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)  # Ray's driver threads can hold a normal exit; the result is written


if __name__ == "__main__":
    main(sys.argv[1])
