"""ReshardCheckpointEngine driven in NeMo-RL's call order on real processes (gloo, shared memory): 2 policy
workers and 2 or 3 rollout workers, each its own process (harness.nemo_rl_jobs; the vLLM side inside a real vLLM
worker is examples/nemo_rl/refit.py, run by tests/integration/examples).

Ground truth: the tensors a rollout worker is yielded must equal, byte for byte, the checkpoint's tensors after the
same training steps, computed in that process from the checkpoint file (independent of reshard). The sending is
spread: each policy worker keeps and sends only what the plans read from it, and with fan-out (3 rollout workers
fed by 2 policy workers) fewer copies leave the policy. Batches are at most `bucket_size` bytes and the worker
holds two of them ("bucket" staging) or the whole model ("model"). Pipelined: while vLLM loads batch 0 (made to
take a second) the next group lands, and the policy workers go on draining their streams while groups move.

A policy worker whose stream is wrong -- a tensor the model does not have before the model's own, a misshapen
tensor in the middle, a tensor the model does not have after the last one -- fails the refit on every process
within seconds of the refusal; with "model" staging no rollout worker is yielded anything, with "bucket" staging
only batches every process agreed on, never the one holding the bad tensor and never the last; the next refit
moves a whole version again. A vLLM worker whose loader raises mid-refit fails the others the same way.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from reshard.layouts import ModelSpec
from reshard.testing.megatron_cpu import TinyGPT
from harness.serve_jobs import make_checkpoint
from harness.shm import left_behind, segments
from reshard.testing.world import run_world

pytestmark = pytest.mark.gloo

JOB = "harness.nemo_rl_jobs:nemo_rl_worker"
BUCKET = 20_000  # bytes: the tiny models (~0.4 MB) move in about 20 groups
FAIL_FAST_S = 20.0  # the bound the test holds a refusal to; the engine's timeout is 60 s, the measured time ~1 s


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("nemo-rl")
    return {"dense": str(make_checkpoint(TinyGPT(), root / "dense")),
            "moe": str(make_checkpoint(TinyGPT(num_experts=4), root / "moe"))}


def _run(tmp_path, checkpoint, policy, rollout, steps=2, **job):
    job = {"checkpoint": checkpoint, "policy": policy, "rollout": rollout, "steps": steps, "dir": str(tmp_path),
           **job}
    results = run_world(policy + rollout, JOB, job, tmp_path, timeout=240)
    assert all(r is not None for r in results), (tmp_path / "logs.txt").read_text()[-4000:]
    return results[:policy], results[policy:]


@pytest.mark.parametrize("model,rollouts,options,release", [
    ("dense", 3, {"fanout": 1}, True),
    ("moe", 2, {"staging": "model"}, False),
    ("dense", 2, {"transport": "shared"}, False),
], ids=["dense-fanout-bucket", "moe-model-staging", "dense-shared-memory"])
def test_rollout_workers_get_the_trained_tensors_from_every_policy_worker(tmp_path, checkpoints, model, rollouts,
                                                                          options, release):
    """release: finalize after every refit and meet again before the next (NeMo-RL's release_after_refit)."""
    before = segments()
    policy, rollout = _run(tmp_path, checkpoints[model], 2, rollouts, bucket_size=BUCKET, kwargs=options,
                           release_after_refit=release, first_load_seconds=1.0)
    groups = rollout[0]["groups"]
    assert len(groups) > 5
    for r in rollout:
        for entry in r["refits"]:
            assert "error" not in entry, entry
            assert entry["equal"], entry["wrong"]
            assert [b["names"] for b in entry["batches"]] == groups  # one batch per group, in model order
            assert all(b["bytes"] <= BUCKET for b in entry["batches"] if len(b["names"]) > 1)
            if options.get("staging", "bucket") == "bucket":  # group 1 landed while vLLM loaded batch 0
                assert entry["landed_at"][1] < entry["first_loaded_at"], entry["landed_at"][:2]
        held = r["refits"][-1]["held_bytes"]
        if options.get("staging") == "model":
            assert held >= r["model_bytes"]
        else:  # two buckets (a bucket: the largest batch, each tensor 256-byte aligned), never the model
            largest = max(b["bytes"] + 256 * len(b["names"]) for b in r["refits"][-1]["batches"])
            assert held <= 2 * largest and held < r["model_bytes"] / 4
    for p in policy:
        assert all(e["layout"] is None for e in p["refits"])  # NeMo-RL filters nothing (benchmarks/nemo_rl_filter.py)
        assert all(e["drained_while_moving"] > 0 for e in p["refits"])  # the stream went on while groups moved
    model_bytes = rollout[0]["model_bytes"]
    sent = [p["refits"][-1]["bytes_sent"] for p in policy]
    assert all(s > 0 for s in sent)  # both policy workers send ...
    assert max(sent) < 0.75 * sum(sent)  # ... about half each
    if options.get("fanout"):  # the rollout workers relay: fewer copies leave the policy
        assert model_bytes <= sum(sent) < rollouts * model_bytes
    else:
        assert sum(sent) == rollouts * model_bytes
    spec = ModelSpec.from_hf_config(checkpoints[model])
    kept = [p["refits"][-1]["kept"] for p in policy]  # each worker keeps only its share of the stream
    assert max(kept) < len(spec.tensors) <= sum(kept)
    assert not left_behind(before)  # shared memory: no bucket's name left in /dev/shm


@pytest.mark.parametrize("transport", ["collective", "shared"])
def test_delta_refits_move_only_the_changes(tmp_path, checkpoints, transport):
    """`delta: 3` with model staging, 2% of the elements changed by one ulp per step: refits 1 and 4 keyframes, 2
    and 3 deltas carrying a small part of the dense bytes; refit 5 refused (a tensor the model does not have, after
    the last one): nothing handed on; refit 6, a delta by the schedule, is a keyframe (the transport is rebuilt after
    a failure). Every batch handed on equals the checkpoint's tensors after the same steps (ground truth)."""
    before = segments()
    policy, rollout = _run(tmp_path, checkpoints["dense"], 2, 2, steps=6, bucket_size=BUCKET, changed=0.02,
                           faults={"5": "extra-last"},
                           kwargs={"staging": "model", "delta": 3, "dtype": "bfloat16", "transport": transport})
    model_bytes = rollout[0]["model_bytes"]
    for r in rollout:
        ok = r["refits"][:4] + r["refits"][5:]
        assert all("error" not in e and e["equal"] for e in ok), r["refits"]
        assert [e["delta"]["keyframes"] == e["delta"]["groups"] for e in ok] == [True, False, False, True, True]
        assert all(e["delta"]["keyframes"] == 0 for e in ok[1:3])
        assert all(e["bytes_received"] == model_bytes for e in (ok[0], ok[3], ok[4]))
        assert all(0 < e["bytes_received"] < 0.25 * model_bytes for e in ok[1:3]), ok
        refused = r["refits"][4]
        assert "model.layers.0.mlp.extra.weight" in refused["error"] and not refused["batches"], refused
    for p in policy:
        for e in p["refits"][1:3]:
            assert 0 < e["delta"]["wire_bytes"] < 0.25 * e["delta"]["dense_bytes"], e["delta"]
        assert all(e["delta"]["wire_bytes"] == e["delta"]["dense_bytes"] for e in p["refits"][3::2])
    assert not left_behind(before)


@pytest.mark.parametrize("staging", ["model", "bucket"])
def test_a_refused_stream_fails_every_process_at_once_and_the_next_refit_is_whole(tmp_path, checkpoints, staging):
    """The last policy worker's stream is wrong at step 2 (an extra tensor first), 3 (a misshapen tensor in the
    middle) and 4 (an extra tensor after the last); at step 5 the first rollout worker's loader raises on batch 3
    (after the end-of-stream verdict with "model" staging: the refit stands elsewhere); steps 1 and 6 are clean
    (every refit after a failed one rebuilds the transport first)."""
    faults, loader = {"2": "extra-first", "3": "misshapen-middle", "4": "extra-last"}, {"5": 3}
    steps = 6
    policy, rollout = _run(tmp_path, checkpoints["dense"], 2, 2, steps=steps, bucket_size=2 * BUCKET, faults=faults,
                           loader_faults=loader, kwargs={"staging": staging, "timeout": 60})
    groups = rollout[0]["groups"]
    where = {name: k for k, group in enumerate(groups) for name in group}
    slowest = 0.0
    for step in range(1, steps + 1):
        culprit = policy[-1] if str(step) in faults else rollout[0]
        faulty = culprit["refits"][step - 1]
        failed = str(step) in faults or (str(step) in loader and staging == "bucket")
        for r in [*policy, *rollout]:
            entry = r["refits"][step - 1]
            if r is culprit or not failed:
                assert ("error" in entry) == (r is culprit and str(step) in {**faults, **loader}), (step, entry)
                continue
            assert "error" in entry, (step, entry)
            slowest = max(slowest, entry["error_at"] - faulty["fault_at"])
            reason = faulty.get("fault_tensor") or "rollout worker 0: ExecutionError: stopped taking batches after 4"
            assert entry["error"].startswith("ExecutionError") and reason in entry["error"], entry["error"]
        for r in rollout:
            entry = r["refits"][step - 1]
            yielded = [b["names"] for b in entry["batches"]]
            assert not entry["wrong"]  # what was yielded is the checkpoint's
            if not failed:
                assert r is culprit or entry["equal"], (step, entry["wrong"])
            elif staging == "model" or faults.get(str(step)) == "extra-first":
                assert yielded == []
            elif faults.get(str(step)) == "misshapen-middle":
                assert yielded == groups[:len(yielded)] and len(yielded) <= where[faulty["fault_tensor"]]
            elif faults.get(str(step)) == "extra-last":  # every batch but the last: it waits for the verdicts
                assert yielded == groups[:-1]
            else:  # the loader failed on batch 3 of one worker: the other had at most the batch landing meanwhile
                assert 4 <= len(yielded) <= 6 and yielded == groups[:len(yielded)]
        if str(step) in faults:
            assert faulty["error"].startswith("ArgumentError") and faulty["fault_tensor"] in faulty["error"]
    print(f"\nfail-fast ({staging} staging): every process raised within {slowest:.2f} s of the refusal")
    assert slowest < FAIL_FAST_S
