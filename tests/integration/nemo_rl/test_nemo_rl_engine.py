"""ReshardCheckpointEngine driven in NeMo-RL's call order on real processes (gloo): 2 policy workers and 2 or 3
rollout workers, each its own process (testing.nemo_rl_jobs; the vLLM side inside a real vLLM worker is
examples/nemo_rl/refit.py, run by tests/integration/examples).

Ground truth: the tensors a rollout worker yields must equal, byte for byte, the checkpoint's tensors after the
same training steps, computed in that process from the checkpoint file (independent of reshard). The sending is
spread: each policy worker keeps and sends only what the plan reads from it (get_target_weight_layout filters
its iterator), and with fan-out (3 rollout workers fed by 2 policy workers) fewer copies leave the policy. A policy
worker that sends a wrong tensor (or one the model does not have) fails the refit on every process and no rollout
worker yields anything.
"""
from __future__ import annotations

import pytest

from reshard.layouts import HfLayout, ModelSpec
from reshard.planner.cache import cached_plan
from reshard.testing.megatron_cpu import TinyGPT
from reshard.testing.serve_jobs import make_checkpoint
from reshard.testing.world import run_world

pytestmark = pytest.mark.gloo

JOB = "reshard.testing.nemo_rl_jobs:nemo_rl_worker"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("nemo-rl")
    return {"dense": str(make_checkpoint(TinyGPT(), root / "dense")),
            "moe": str(make_checkpoint(TinyGPT(num_experts=4), root / "moe"))}


def _run(tmp_path, checkpoint, policy, rollout, **job):
    job = {"checkpoint": checkpoint, "policy": policy, "rollout": rollout, "steps": 2, "dir": str(tmp_path), **job}
    results = run_world(policy + rollout, JOB, job, tmp_path, timeout=240)
    assert all(r is not None for r in results), (tmp_path / "logs.txt").read_text()[-4000:]
    return results[:policy], results[policy:]


@pytest.mark.parametrize("model,rollouts,fanout,release", [("dense", 3, 1, True), ("moe", 2, None, False)])
def test_rollout_workers_get_the_trained_tensors_from_every_policy_worker(tmp_path, checkpoints, model, rollouts,
                                                                          fanout, release):
    """release: finalize after every refit and meet again before the next (NeMo-RL's release_after_refit)."""
    policy, rollout = _run(tmp_path, checkpoints[model], 2, rollouts, bucket_size=20_000, kwargs={"fanout": fanout},
                           release_after_refit=release)
    for r in rollout:
        for entry in r["refits"]:
            assert "error" not in entry, entry
            assert entry["equal"], entry["wrong"]
            assert entry["batches"] > 1 and entry["largest_multi_tensor_batch"] <= 20_000
    model_bytes = rollout[0]["model_bytes"]
    sent = [p["refits"][-1]["bytes_sent"] for p in policy]
    assert all(s > 0 for s in sent)  # both policy workers send ...
    assert max(sent) < 0.75 * sum(sent)  # ... about half each
    spec = ModelSpec.from_hf_config(checkpoints[model])
    plan = cached_plan(HfLayout(model=spec, replicas=2), HfLayout(model=spec, replicas=rollouts), fanout=fanout)
    copies = plan.roots if fanout else rollouts  # with fan-out the rollout workers relay: fewer copies leave the policy
    assert copies < rollouts if fanout else True
    assert sum(sent) == copies * model_bytes
    kept = [p["refits"][-1]["kept"] for p in policy]  # each worker keeps only its share of the iterator
    assert max(kept) < len(spec.tensors) and sum(kept) <= len(spec.tensors) + 2


@pytest.mark.parametrize("fault", ["wrong-shape", "unknown-name"])
def test_a_wrong_tensor_fails_the_refit_everywhere_and_nothing_is_loaded(tmp_path, checkpoints, fault):
    policy, rollout = _run(tmp_path, checkpoints["dense"], 2, 2, fault=fault)
    for r in [*policy, *rollout]:
        first, last = r["refits"]
        assert "error" not in first, first
        assert "ExecutionError" in last["error"], last
    assert ("does not have" in policy[-1]["refits"][-1]["error"]) == (fault == "unknown-name")
    for r in rollout:
        assert "batches" not in r["refits"][-1]  # the generator raised before yielding a batch
        assert r["refits"][0]["equal"]
