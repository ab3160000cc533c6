"""One vLLM TP rank of the test session's world for its TP size (the `vllm_worlds` fixture, conftest.py, launches
one process per rank): vLLM's process groups over gloo are set up once (under a MoE config, so that the
expert-parallel group exists), then, once the fixture wrote OUT_DIR/jobs.json, the jobs of every module sharing
the world run one after another, in its order (the same on every rank: the jobs' collectives pair up):

  test_vllm_install     rank_checks.run_case       test_vllm_fp8     fp8_checks.run_case
  test_vllm_checkpoint  checkpoint_checks.run_case test_lora_slots   lora_slot_checks.run_case

Each job builds its own models from its own checkpoint, so no job reads what another changed. Writes
rank{r}.json: per module, per case, its report, or {"setup": traceback} where the case raised.

    python world_checks.py OUT_DIR MOE_CKPT      (OUT_DIR/jobs.json; RANK / WORLD_SIZE / MASTER_* in the environment)
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402

import vllm_harness as harness  # noqa: E402

RUNS = {"test_vllm_install": "rank_checks", "test_vllm_fp8": "fp8_checks",
        "test_vllm_checkpoint": "checkpoint_checks", "test_lora_slots": "lora_slot_checks"}


def main() -> int:
    out, moe_ckpt = Path(sys.argv[1]), sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    harness.init_parallel(moe_ckpt, world, rank)
    while not (out / "jobs.json").exists():  # written once the modules saved what the jobs read
        time.sleep(0.2)
    jobs = json.loads((out / "jobs.json").read_text())
    report: dict[str, dict] = {}
    for job in jobs:
        with harness.attributed(job):
            try:
                result = importlib.import_module(RUNS[job["module"]]).run_case(job, rank, world)
            except Exception:  # noqa: BLE001 - reported, the case's tests fail on it
                result = {"setup": traceback.format_exc()[-3000:]}
        report.setdefault(job["module"], {})[job["name"]] = result
    harness.write_json(out / f"rank{rank}.json", report)
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
