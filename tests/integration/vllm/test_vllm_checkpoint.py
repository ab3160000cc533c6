"""Refits of real vLLM model code on CPU straight from megatron-core torch_dist checkpoints (dense TP2, PP2 with
VPP2 and tied embeddings, MoE TP2 with EP2 and expert-TP2), at vLLM TP1 and TP2, each byte-identical to vLLM's
own `load_weights` of the HF export of the same weights. The checkpoints are saved by real megatron-core in the
core virtualenv (this one has no megatron-core), with megatron-core's loader writing the HF export
(harness.megatron_ckpt); checkpoint_checks.py runs the vLLM side, in the session's world of each TP size
(conftest.py's vllm_worlds), one process per TP rank, each rank one reader of the checkpoint reading only its part.
"""
from __future__ import annotations

import os
import subprocess

import pytest

from harness import pythonpath

from vllm_harness import ROOT

pytestmark = pytest.mark.vllm

CASES = ["dense_tp2", "dense_pp2_vpp2_tied", "moe_tp2_ep2_etp2"]


def world_jobs(selected, checkpoints, out):
    """This module's cases for the session's worlds (conftest.vllm_worlds), per world the selected ones; the
    checkpoints they read saved first (those cases' only)."""
    core = ROOT / ".venv" / "bin" / "python"
    if not core.exists():
        pytest.skip("the core virtualenv (.venv, with megatron-core) saves the checkpoints")
    saved = [c for c in CASES if any(c in cases for cases in selected.values())]
    env = dict(os.environ, PYTHONPATH=pythonpath())
    subprocess.run([str(core), "-m", "harness.megatron_ckpt", str(out / "cases"), *saved], env=env,
                   check=True, timeout=900, cwd=str(ROOT), stdout=subprocess.DEVNULL)
    return {world: [{"name": c, "dir": str(out / "cases" / c)} for c in CASES if c in cases]
            for world, cases in selected.items()}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_refit_from_checkpoint_equals_vllm_loading_hf_export(reports, world, case):
    for rank, report in enumerate(reports[world]):
        assert "setup" not in report[case], f"tp{world} rank {rank} {case}: {report[case].get('setup')}"
        assert report[case]["result"] == "ok", f"tp{world} rank {rank} {case}: {report[case]['result']}"
    read = [r[case]["bytes_read"] for r in reports[world]]
    total = reports[world][0][case]["checkpoint_bytes"]
    assert sum(read) < total, (read, total)  # no byte range read twice, and never the framing of every record
    if world == 2:
        assert all(0 < b < 0.75 * total for b in read), (read, total)  # each reader read its part only
