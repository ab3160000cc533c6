"""reshard's verl backend driven by verl's own code on CPU: the real CheckpointEngineManager, trainer-side
ActorRolloutRefWorker.update_weights and rollout-side CheckpointEngineWorker over a local Ray cluster (CPU
resource pools), 2 trainer ranks (a megatron-core MoE model: fused QKV, gated MLP, experts; exported as HF
tensors) into 3 rollout ranks. What the rollout side serves is compared byte for byte (SHA-256 per tensor) with
the trainer model's HF tensors. The workers are the session's (conftest.py's `megatron_refit`, which
test_verl_guide.py refits with too), reset as the module starts; its tests run in order and each starts from a
successful refit of its own. Refused streams: test_verl_exporter_streams.py."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from harness import verl_cpu as vc

pytestmark = pytest.mark.verl

TRAINERS, ROLLOUTS = 2, 3
OPTIONS = {"timeout": 60.0}


@pytest.fixture(scope="module")
def cluster(megatron_refit):
    assert (megatron_refit.num_trainers, megatron_refit.num_rollouts) == (TRAINERS, ROLLOUTS)
    megatron_refit.reset(vc.checkpoint_engine_config(megatron_refit.checkpoint, 1, **OPTIONS))
    return megatron_refit


def ce(cluster, **options):
    return vc.checkpoint_engine_config(cluster.checkpoint, 1, **{**OPTIONS, **options})


def check_served(cluster, step, ranks=None):
    expected = cluster.expected()
    served = cluster.served()
    for r, (version, digests) in enumerate(served):
        if ranks is not None and r not in ranks:
            continue
        assert version == step, f"rollout rank {r} serves step {version}, expected {step}"
        wrong = sorted(n for n in expected if digests.get(n) != expected[n])
        assert not wrong and set(digests) == set(expected), f"rollout rank {r}: {wrong[:5]} differ"
    return served


def test_refits_2_to_3_bytes_egress_and_bucket(cluster):
    spec = vc.ModelSpec.from_hf_config(cluster.checkpoint)
    largest = max(t.numel * spec.itemsize for t in spec.tensors)
    assert largest > 1 << 20, "the model must have a tensor larger than the 1 MiB bucket"
    model_bytes = sum(t.numel * spec.itemsize for t in spec.tensors)
    for step in (1, 2, 3):  # several refits in a row, the weights changing between them
        cluster.trainers.train_step(step)
        metrics = cluster.refit(step)
        check_served(cluster, step)
        egress = [metrics[f"reshard/trainer{p}/egress_bytes"] for p in range(TRAINERS)]
        assert sum(egress) == ROLLOUTS * model_bytes  # whole tensors to every rollout rank, once
        assert min(egress) > 0.4 * sum(egress), f"sending not spread over the trainer ranks: {egress}"


def test_fanout_sends_one_copy_from_the_trainers(cluster):
    cluster.reconfigure(ce(cluster, fanout=1))
    try:
        spec = vc.ModelSpec.from_hf_config(cluster.checkpoint)
        model_bytes = sum(t.numel * spec.itemsize for t in spec.tensors)
        cluster.trainers.train_step(4)
        metrics = cluster.refit(4)
        check_served(cluster, 4)
        egress = [metrics[f"reshard/trainer{p}/egress_bytes"] for p in range(TRAINERS)]
        assert sum(egress) == model_bytes and min(egress) > 0.4 * model_bytes, egress
    finally:
        cluster.reconfigure(ce(cluster))


@pytest.mark.parametrize("transport", ["shared", "nixl"])
def test_other_transports_with_checksums(cluster, transport):
    cluster.reconfigure(ce(cluster, transport=transport, checksum=True))
    try:
        cluster.trainers.train_step(5)
        cluster.refit(5)
        check_served(cluster, 5)
    finally:
        cluster.reconfigure(ce(cluster))


def test_delta_refits_move_only_the_changes(cluster):
    """`delta: 3` with "model" staging: the first refit after the engines were made is dense, the next two deltas
    of the 2% of elements each step changed, the fourth dense again (K = 3); every rollout rank serves the trainer
    model's tensors at every step (SHA-256 per tensor), delta or not. Then a refused stream (a misshapen tensor)
    fails a refit: the rollout ranks keep the last version whole, and the next refit, a delta by the schedule, is
    dense (the backend drops what it knew of the other side), the one after a delta again."""
    cluster.reconfigure(ce(cluster, staging="model", delta=3))
    try:
        spec = vc.ModelSpec.from_hf_config(cluster.checkpoint)
        dense = ROLLOUTS * sum(t.numel * spec.itemsize for t in spec.tensors)

        def refit(step: int) -> dict[str, float]:
            cluster.trainers.train_step(step, 0.02)
            metrics = cluster.refit(step)
            check_served(cluster, step)
            return {key: sum(metrics[f"reshard/trainer{p}/{key}"] for p in range(TRAINERS))
                    for key in ("egress_bytes", "keyframe_groups", "delta_bytes", "dense_bytes")}

        moved = [refit(step) for step in (6, 7, 8, 20)]
        every = moved[0]["keyframe_groups"]
        assert every > 0 and [m["keyframe_groups"] for m in moved] == [every, 0, 0, every], moved
        for m in moved:
            assert m["dense_bytes"] == dense and m["egress_bytes"] == m["delta_bytes"], m
        assert moved[0]["egress_bytes"] == moved[3]["egress_bytes"] == dense, moved
        assert all(0 < m["egress_bytes"] < 0.25 * dense for m in moved[1:3]), moved

        before = check_served(cluster, 20)
        cluster.trainers.set_fault({"kind": "shape", "at": 3}, 0)
        cluster.trainers.train_step(21, 0.02)
        with pytest.raises(Exception, match="does not match the model"):
            cluster.refit(21)
        assert cluster.served() == before  # all or nothing: the last version, whole
        cluster.trainers.set_fault({}, 0)
        after = [refit(22), refit(23)]
        assert [m["keyframe_groups"] for m in after] == [every, 0], after
        assert after[0]["egress_bytes"] == dense and after[1]["egress_bytes"] < 0.25 * dense, after
    finally:
        cluster.trainers.set_fault({}, 0)
        cluster.reconfigure(ce(cluster))


def refit_in_background(cluster, step: int) -> tuple[threading.Thread, list[BaseException]]:
    """Start `cluster.refit(step)` on a thread (the test meanwhile acts on the workers); what it raised, once joined,
    lands in the returned list."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            cluster.refit(step)
        except BaseException as e:  # noqa: BLE001 - examined by the caller
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


def until_ended(cluster, rank: int, step: int, deadline: float) -> dict:
    """Rollout rank `rank`'s server-adapter call for `step` once it ended (or, at the deadline, as it stands)."""
    import ray

    while True:
        call = [c for c in ray.get(cluster.rollouts.workers[rank].calls.remote(), timeout=30) if c["step"] == step]
        if (call and call[-1]["ended"] is not None) or time.monotonic() > deadline:
            return call[-1] if call else {}
        time.sleep(0.05)


@pytest.mark.parametrize("staging,options", [("bucket", {}), ("model", {"delta": 3})], ids=["bucket", "model-delta"])
def test_an_adapter_failing_on_the_last_group_fails_its_own_update_only(cluster, tmp_path: Path, staging, options):
    """Rollout rank 0's server adapter raises when handed the refit's last tensor (as vLLM's load_weights may),
    after the trainers' end-of-stream verdict: by then every process has moved every group and agreed on it.
    Rank 0 did not load the whole version, so verl's caller (the manager's update_weights) raises with the
    adapter's error and rank 0 keeps reporting its previous version (verl's adapters set the new one only after a
    complete update). The other ranks have every group and every agreement: they load the whole version and report
    it, even one still handing on an earlier group when rank 0 failed ("bucket": rank 1 held at the second-to-last
    group until then). A stop after the verdict fails no other process: the backend posts no failure then (as
    NeMo-RL's; before the shared pipeline verl's posted one, which failed a rank still waiting for the verdict).
    The next refit is whole everywhere; with delta it is a delta (no keyframe): rank 0's staging buffers hold the
    version every process agreed on, so what the backend knows of them stays true."""
    import ray

    from reshard.integrations.groups import tensor_groups

    cluster.reconfigure(ce(cluster, staging=staging, **options))
    culprit, late = cluster.rollouts.workers[0], cluster.rollouts.workers[1]
    try:
        cluster.trainers.train_step(30)
        cluster.refit(30)
        before = check_served(cluster, 30)
        names = cluster.rollouts.calls()[1][-1]["names"]  # the order every rank is handed the tensors in
        groups = tensor_groups(vc.ModelSpec.from_hf_config(cluster.checkpoint), 1 << 20)  # the engines' (1 MiB)
        where = {name: k for k, group in enumerate(groups) for name in group}
        starts = [i for i, n in enumerate(names) if i == 0 or where[n] != where[names[i - 1]]]  # each group's first
        assert len(starts) == len(groups) > 2, starts
        go = tmp_path / "go"
        ray.get(culprit.fail_at.remote(len(names) - 1))  # rank 0: the last group, past the verdict
        if staging == "bucket":  # rank 1: before its verdict until rank 0 has failed (its thread moves the last)
            ray.get(late.hold.remote(str(go), starts[-2]))
        cluster.trainers.train_step(31)
        thread, errors = refit_in_background(cluster, 31)
        failed = until_ended(cluster, 0, 31, time.monotonic() + 120)
        time.sleep(1.0)  # room for a failure posted on rank 0's stop to reach the store, were one posted
        go.touch()
        touched = time.monotonic()  # (the workers' clock too: one host)
        thread.join(OPTIONS["timeout"] * 2)
        assert not thread.is_alive(), "the refit did not end"
        assert failed.get("ended") is not None and failed["ended"] < touched, "rank 0's adapter did not fail"
        assert errors and "load_weights failed on" in str(errors[0]), "verl's caller was not told: " + str(errors)
        expected = cluster.expected()
        calls = [failed] + [until_ended(cluster, r, 31, time.monotonic() + 60) for r in range(1, ROLLOUTS)]
        served = cluster.served()
        # rank 0: handed every tensor, the last not loaded; still reports step 30 (what it loaded is step 31's)
        assert not failed["ok"] and failed["names"] == names, failed
        version, digests = served[0]
        assert version == 30, f"rollout rank 0 reports step {version} after its adapter failed"
        assert all(digests[n] == expected[n] for n in names[:-1]) and digests[names[-1]] == before[0][1][names[-1]]
        if staging == "bucket":  # rank 1 was still before its verdict when rank 0 failed
            assert calls[1]["ended"] > touched, calls[1]
        for r in range(1, ROLLOUTS):  # the refit stands there: whole, and reported
            assert calls[r].get("ok"), f"rollout rank {r}'s update failed after rank 0's adapter stopped past the " \
                                       f"verdict: {calls[r]}"
        check_served(cluster, 31, ranks=range(1, ROLLOUTS))
        ray.get([culprit.fail_at.remote(None), late.hold.remote(None)])
        cluster.trainers.train_step(32)
        metrics = cluster.refit(32)
        check_served(cluster, 32)
        if options.get("delta"):
            assert all(metrics[f"reshard/trainer{p}/keyframe_groups"] == 0 for p in range(TRAINERS)), metrics
    finally:
        ray.get([culprit.fail_at.remote(None), late.hold.remote(None)])
        cluster.reconfigure(ce(cluster))


def old_or_new(served, before, expected) -> list[str]:
    """The tensors a rollout rank serves that are neither its previous bytes nor the new version's ("bucket"
    staging: a failed refit leaves some groups of the new version loaded, the rest old)."""
    return [n for n in expected if served[n] not in (before[n], expected[n])]


def test_trainer_killed_mid_refit(cluster):
    cluster.refit(8)
    before = check_served(cluster, 8)
    cluster.trainers.set_fault({"kind": "exit", "at": 10}, 1)
    cluster.trainers.train_step(9)
    start = time.monotonic()
    with pytest.raises(Exception) as failure:
        cluster.refit(9)
    assert time.monotonic() - start < OPTIONS["timeout"], "the survivors waited for the timeout"
    assert "died" in str(failure.value) or "ExecutionError" in str(failure.value)
    import ray

    expected = ray.get(cluster.trainers.workers[0].hf_digests.remote())  # trainer rank 1 is gone
    for (version, served), (_, old) in zip(cluster.served(), before):
        assert version == 8 and not old_or_new(served, old, expected)
    cluster.replace_trainers()  # verl restarts the trainer group; the rollout workers are the same
    cluster.trainers.train_step(10)
    cluster.refit(10)
    check_served(cluster, 10)


def test_rollout_killed_mid_refit(cluster, tmp_path: Path):
    """All or nothing ("model" staging): the survivors keep their weights whole. While the refit waits for the
    trainers, the rollout workers answer other calls."""
    cluster.reconfigure(ce(cluster, staging="model"))
    cluster.refit(11)
    before = check_served(cluster, 11)
    reached, go = tmp_path / "reached", tmp_path / "go"
    cluster.trainers.set_fault({"kind": "wait", "at": 10, "reached": str(reached), "go": str(go)}, 0)
    cluster.trainers.train_step(12)
    thread, errors = refit_in_background(cluster, 12)
    deadline = time.monotonic() + 120
    while not reached.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert reached.exists(), "the refit never reached the fault"
    import ray

    # mid-refit, the rollout workers' event loops are free (the transfers wait on a thread): they answer at once
    assert ray.get(cluster.rollouts.workers[0].served.remote(), timeout=30) == before[0]
    cluster.kill_rollout(2)
    go.touch()
    thread.join(OPTIONS["timeout"] * 2)
    assert not thread.is_alive() and errors, "the refit did not fail"
    served = cluster.served_by([0, 1])
    assert served == before[:2]  # the survivors kept their previous weights
    cluster.trainers.set_fault({}, 0)
    cluster.drop_replica(2)  # verl's elastic scale-down: refit the replicas that are left
    cluster.refit(13)
    for version, digests in cluster.served_by([0, 1]):
        assert version == 13 and digests == cluster.expected()
