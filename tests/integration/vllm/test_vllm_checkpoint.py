"""Refits of real vLLM model code on CPU straight from megatron-core torch_dist checkpoints (dense TP2, PP2 with
VPP2 and tied embeddings, MoE TP2 with EP2 and expert-TP2), at vLLM TP1 and TP2, each byte-identical to vLLM's
own `load_weights` of the HF export of the same weights. The checkpoints are saved by real megatron-core in the
core virtualenv (this one has no megatron-core), with megatron-core's loader writing the HF export
(harness.megatron_ckpt); checkpoint_checks.py runs the vLLM side, one process per TP rank, each rank one
reader of the checkpoint reading only its part.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness import pythonpath

from vllm_harness import HERE, ROOT, collected, launch, wait

pytestmark = pytest.mark.vllm

CASES = ["dense_tp2", "dense_pp2_vpp2_tied", "moe_tp2_ep2_etp2"]


@pytest.fixture(scope="module")
def reports(tmp_path_factory, request):
    core = ROOT / ".venv" / "bin" / "python"
    if not core.exists():
        pytest.skip("the core virtualenv (.venv, with megatron-core) saves the checkpoints")
    worlds = collected(request, {1: CASES, 2: CASES})
    saved = [c for c in CASES if any(c in names for names in worlds.values())]
    # the MoE case's HF export initializes vLLM's expert-parallel config in every world
    saved = sorted(set(saved) | {"moe_tp2_ep2_etp2"}, key=CASES.index)
    out = tmp_path_factory.mktemp("megatron_ckpt")
    env = dict(os.environ, PYTHONPATH=pythonpath())
    subprocess.run([str(core), "-m", "harness.megatron_ckpt", str(out / "cases"), *saved], env=env,
                   check=True, timeout=900, cwd=str(ROOT), stdout=subprocess.DEVNULL)
    moe_hf = str(out / "cases" / "moe_tp2_ep2_etp2" / "ref")
    running = {}
    for world, names in worlds.items():
        (out / f"w{world}").mkdir()
        cases = [str(out / "cases" / c) for c in names]
        running[world] = launch(sys.executable, HERE / "checkpoint_checks.py", [str(out / f"w{world}"), moe_hf,
                                                                                 *cases], world, out)
    for procs in running.values():
        wait(procs, timeout=1200)
    return {world: [json.loads((out / f"w{world}" / f"rank{r}.json").read_text()) for r in range(world)]
            for world in worlds}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_refit_from_checkpoint_equals_vllm_loading_hf_export(reports, world, case):
    for rank, report in enumerate(reports[world]):
        assert report[case]["result"] == "ok", f"tp{world} rank {rank} {case}: {report[case]['result']}"
    read = [r[case]["bytes_read"] for r in reports[world]]
    total = reports[world][0][case]["checkpoint_bytes"]
    assert sum(read) < total, (read, total)  # no byte range read twice, and never the framing of every record
    if world == 2:
        assert all(0 < b < 0.75 * total for b in read), (read, total)  # each reader read its part only
