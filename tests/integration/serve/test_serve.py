"""Refit a running vLLM server (the vLLM CPU build, its own virtualenv, default multiprocessing) from megatron-core
trainer processes in this virtualenv, which has no vLLM, through the server's HTTP routes.

Ground truth: each server is started on checkpoint B, the weights after one training step (an elementwise
function of checkpoint A, applied in this process: independent of Megatron and of reshard), and its greedy
tokens and vLLM's own weight checksums are recorded first (the directory's shared servers, harness.serve_pool:
each test takes its server as a fresh one on B answers, whatever ran before). Trainer processes loaded with A
refit it (its tokens must change), take the training step and refit again: tokens and checksums must equal the
fresh server's, and the server must report the trainer's weight version. Both sides compile the plan once.
In one case the trainer also saves that step as a megatron-core torch_dist checkpoint, refits one more step, and
its processes then refit the server straight from the checkpoint (readers with no model, each reading its part):
the fresh server's output again. Delta refits (`RefitSpec(delta=K)`) after a few elements and a training step
changed land exactly the expected checkpoint's tensors, keyframes as the policy says and after every init.

Faults and bad input (each bounded in time): a trainer process dies as a refit starts -> the server's update
fails, it keeps serving the previous weights, and a new init + refit succeeds; the server dies mid-update ->
every trainer process raises; an init with a wrong model, layout, plan digest, store address, secret or a
duplicate rank -> a clear error over HTTP and in the trainer, the server still serving.
"""
from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import reshard
from reshard.adapters.refit import RefitSpec
from reshard.adapters.trainer import TrainerSession
from reshard.errors import ExecutionError
from reshard.adapters import rendezvous as rv
from reshard.executors import shard
from reshard.executors.checksum import tensor_digests
from reshard.ports import free_port
from reshard.testing.megatron_cpu import TinyGPT, run_ranks
from harness.serve_jobs import load_checkpoint, refit_server
from harness.serve_pool import PROMPTS, SERVERS, Served

pytestmark = pytest.mark.crossprocess


@pytest.fixture
def servers(serve_pool):
    """The four shared servers (dense/MoE x TP 1/2 on checkpoint B, harness.serve_pool), their start-ups overlapping;
    each test takes its server's fresh state from `servers.fresh(name)`."""
    serve_pool.start(*SERVERS)
    return serve_pool


def _run(served: Served, tmp_path: Path, transport: str, tp: int, pp: int = 1, ep: int = 1, **extra) -> dict:
    out = tmp_path / f"trainer-{time.monotonic_ns()}.json"
    job = {"tiny": served.tiny, "tp": tp, "pp": pp, "ep": ep,
           "etp": 1 if ep > 1 else None, "url": served.client.url, "server_tp": served.tp,
           "checkpoint": str(served.a), "transport": transport, "steps": 2, "out": str(out), "prompts": PROMPTS,
           "worker_stats": True, **extra}
    world = max(tp * pp, ep)
    run_ranks(world, refit_server, job, timeout=600, errdir=str(tmp_path), wait_all=bool(extra.get("fault")))
    result = json.loads(out.read_text())
    assert "exception" not in result, result["exception"]
    return result


def _assert_refit_equals_fresh(served: Served, result: dict) -> None:
    first, last = result["refits"][0], result["refits"][-1]
    assert "error" not in first and "error" not in last, (first.get("error"), last.get("error"))
    assert first["tokens"] != served.fresh, "refitting the weights before the step did not change the tokens"
    assert last["tokens"] == served.fresh, "after the step's refit the tokens differ from a fresh server's"
    assert last["checksums"] == served.checksums, "vLLM's weight checksums differ from a fresh server's"
    # reshard's own digest of every whole tensor that landed on every worker, before vLLM repacks it (vLLM's
    # checksums hash repacked parameters of the CPU build as empty input): the fresh server's checkpoint file
    want = tensor_digests(load_checkpoint(served.b))
    assert last["landed"] and all(w["installed"] and w["digests"] == want for w in last["landed"])
    assert last["weight_version"] == last["version"] == "step-1"
    # both sides compiled the plan once, at init; the refits reused it
    assert result["compiles_after_refits"] == result["compiles_after_init"]
    after_init = [s["compiles"] for s in result["worker_stats_after_init"]]
    assert [s["compiles"] for s in result["worker_stats_after_refits"]] == after_init


@pytest.mark.parametrize("server,transport,tp,pp,ep", [
    ("dense-tp1", "collective", 2, 1, 1), ("dense-tp1", "shared", 2, 2, 1), ("dense-tp1", "nixl", 2, 1, 1),
    ("dense-tp2", "collective", 2, 2, 1), ("dense-tp2", "shared", 2, 1, 1),
    ("moe-tp1", "collective", 2, 1, 2), ("moe-tp1", "shared", 2, 2, 1),
    ("moe-tp2", "collective", 2, 2, 1), ("moe-tp2", "nixl", 2, 1, 2)])
def test_refit_equals_fresh_server(servers, tmp_path, server, transport, tp, pp, ep):
    served = servers.fresh(server)
    # one case also refits the server straight from a megatron-core checkpoint its trainer saved (issue 33)
    from_checkpoint = (server, transport, tp, pp) == ("dense-tp2", "collective", 2, 2)
    extra = {"from_checkpoint": str(tmp_path / "ckpt")} if from_checkpoint else {}
    (tmp_path / "ckpt").mkdir()
    result = _run(served, tmp_path, transport, tp, pp, ep, **extra)
    _assert_refit_equals_fresh(served, result)
    assert result["layout"].startswith(f"megatron:tp={tp},pp={pp},ep={ep},")
    if from_checkpoint:
        _assert_checkpoint_refit_equals_fresh(served, result["from_checkpoint"])


def _assert_checkpoint_refit_equals_fresh(served: Served, result: dict) -> None:
    """The trainer saved step 1's weights (checkpoint B's) with dist_checkpointing, refit step 2 live, then its
    processes, as readers of the checkpoint, refit the server from it: a fresh server's tokens and checksums, the
    digests of checkpoint B's tensors, each reader reading its part of the checkpoint's records."""
    before, after = result["before"], result["after"]
    assert before["tokens"] != served.fresh, "the step after the saved one did not change the tokens"
    assert "error" not in after, after.get("error")
    assert after["tokens"] == served.fresh and after["checksums"] == served.checksums
    want = tensor_digests(load_checkpoint(served.b))
    assert after["landed"] and all(w["installed"] and w["digests"] == want for w in after["landed"])
    assert after["weight_version"] == "checkpoint-step-1"
    read, total = after["bytes_read"], after["record_bytes"]
    assert len(read) > 1 and all(0 < b < 0.75 * total for b in read) and sum(read) < total, (read, total)


def _trainer_of_one(served: Served, **changes) -> tuple[RefitSpec, dict]:
    """A one-process trainer in this process (plain tensors in a Megatron TP1 layout): enough for init checks."""
    spec = reshard.ModelSpec.from_hf_config(served.a)
    src = reshard.MegatronLayout(model=spec, vocab_divisor=64)
    dst = reshard.VllmLayout(model=spec, tp=served.tp)
    refit = RefitSpec.of(spec, src, dst, install="loader", transport="collective", **changes)
    return refit, shard(src, load_checkpoint(served.a))[0]


def _still_serving(served: Served, tokens: list) -> None:
    assert served.client.healthy()
    assert served.client.greedy(PROMPTS) == tokens


def test_bad_init_is_refused_and_the_server_keeps_serving(servers):
    served = servers.fresh("dense-tp1")
    before = served.client.greedy(PROMPTS)
    refit, tensors = _trainer_of_one(served)
    moe = reshard.ModelSpec.from_hf_config(TinyGPT(num_experts=4).hf_config().to_dict())
    rdv, store = rv.host_store(rv.Rendezvous.new(timeout=5.0))
    good = replace(refit, rendezvous=rdv.to_dict(), plan_digest=refit.plan().digest)
    cases = {
        "wrong model": (RefitSpec.of(moe, reshard.MegatronLayout(model=moe), reshard.VllmLayout(model=moe),
                                     install="loader", transport="collective", rendezvous=rdv.to_dict()),
                        "does not match the declared layout"),
        "wrong layout": (replace(good, dst={**good.dst, "vocab_padding": 256}), "the engine runs vllm:tp=1"),
        "plan digest": (replace(good, plan_digest="0" * 64), "differs from the one this worker compiled"),
        "unreachable store": (replace(good, rendezvous={**rdv.to_dict(), "port": free_port()}),
                              "the refit's store: cannot reach"),
        "wrong secret": (replace(good, rendezvous={**rdv.to_dict(), "secret": "f" * 32}), "is not the refit's"),
        "unknown field": (None, "unknown fields ['mode']"),
    }
    for name, (payload, message) in cases.items():
        t0 = time.monotonic()
        body = {**good.to_dict(), "mode": "direct"} if payload is None else payload.to_dict()
        with pytest.raises(ExecutionError) as e:
            served.client.init_weight_transfer_engine(body)
        assert message in str(e.value), f"{name}: {e.value}"
        assert time.monotonic() - t0 < 30, f"{name}: refused only after {time.monotonic() - t0:.0f} s"
        _still_serving(served, before)
    assert rv.refused(store, rdv) and rv.refused(store, rdv)[0]["role"] == "engine"  # the host can log them
    # a duplicate rank: another process already holds the worker's place in the refit
    store.compare_set(f"{rdv.namespace}member/1", "", json.dumps({"role": "stranger", "pid": 1, "host": "x"}))
    with pytest.raises(ExecutionError, match="place 1 is already taken by the stranger process"):
        served.client.init_weight_transfer_engine(good.to_dict())
    _still_serving(served, before)
    # the trainer is told too, with the engine's message
    session = TrainerSession(replace(refit, dst={**refit.dst, "vocab_padding": 256}), 0, tensors,
                             engines=[served.client], timeout=60.0)
    with pytest.raises(ExecutionError, match="the engine runs vllm:tp=1"):
        session.init()
    session.close()
    _still_serving(served, before)
    # a good session refits, and meets the engine again (a new refit id, a new group) when init is called again
    session = TrainerSession(refit, 0, tensors, engines=[served.client], timeout=60.0)
    for k in range(2):
        session.init()
        session.refit(version=f"one-process-{k}")
        assert served.client.weight_info() == f"one-process-{k}"
    session.close()


@pytest.mark.parametrize("transport", ["collective", "shared", "nixl"])
def test_delta_refits_equal_dense_ones(servers, transport):
    """RefitSpec(delta=K) on the server path (issue 41 item 5): a keyframe of checkpoint A, a delta after a few
    elements changed, a delta after a training step (checkpoint B: the fresh server's tokens and checksums), a
    keyframe per the policy, and after a new init a keyframe again (the engine's workers bound afresh hold no
    version a delta could be computed against). Every refit leaves on every worker exactly the expected
    checkpoint's tensors (reshard's digests of what landed); the trainer's RefitResult says what went as delta."""
    served = servers.fresh("dense-tp2")
    refit, _ = _trainer_of_one(served, delta=3)
    refit = replace(refit, transport=transport)
    src, _ = refit.layouts()
    weights = load_checkpoint(served.a)
    tensors = shard(src, weights)[0]  # the trainer's, changed in place by its steps

    def trainer_holds(new: dict) -> None:
        weights.update(new)
        with torch.no_grad():
            for name, t in shard(src, weights)[0].items():
                tensors[name].copy_(t)

    def refit_and_check(version: str):
        result = session.refit(version)
        want = tensor_digests(weights)
        landed = served.client.landed()
        assert len(landed) == 2 and all(w["installed"] and w["digests"] == want for w in landed), version
        assert served.client.weight_info() == version
        if not result.delta.keyframe:  # a delta's bytes are its payloads': what the transport's stats count
            assert sum(result.stats.bytes_sent.values()) == result.delta.wire_bytes, result
        return result.delta

    session = TrainerSession(refit, 0, tensors, engines=[served.client], timeout=120.0)
    try:
        session.init()
        assert refit_and_check("delta-0").keyframe
        names = sorted(n for n, t in weights.items() if t.dim() == 2)
        few = {names[0]: weights[names[0]].clone(), names[-1]: weights[names[-1]].clone()}
        few[names[0]][3, :2] += 1.0
        few[names[-1]][1, 5] -= 2.0
        trainer_holds(few)
        report = refit_and_check("delta-1")
        # 3 elements to each of the 2 workers (a loader install: whole tensors on every rank)
        assert not report.keyframe and report.base == 1 and report.changed == 6, report
        assert report.wire_bytes < report.dense_bytes // 50, report
        trainer_holds(load_checkpoint(served.b))  # the training step: checkpoint B, every element changed
        report = refit_and_check("delta-2")
        assert not report.keyframe and report.base == 2 and report.entries == report.ops["dense"], report
        assert served.client.greedy(PROMPTS) == served.fresh
        assert served.client.weight_checksums() == served.checksums
        assert refit_and_check("delta-3").keyframe  # the policy's: a keyframe every 3 versions
        session.init()  # a new init (as after an engine restart): its first refit is a keyframe
        assert refit_and_check("delta-4").keyframe
        assert not refit_and_check("delta-5").keyframe  # nothing changed: a delta of no entries
    finally:
        session.close()
    assert served.client.greedy(PROMPTS) == served.fresh


def test_a_trainer_process_dies_mid_update_the_server_keeps_its_weights_and_recovers(servers, tmp_path):
    served = servers.fresh("dense-tp2")
    timeout = 10.0
    result = _run(served, tmp_path, "collective", 2, 2, fault="trainer-exit-1", options={"timeout": timeout},
                  timeout=3 * timeout)
    first, failed = result["refits"]
    assert "error" not in first and "error" in failed, result["refits"]
    assert failed["seconds"] < timeout + 15, f"the refit failed only after {failed['seconds']:.0f} s"
    # the server kept the previous refit's weights, whole, and its version
    assert failed["tokens"] == first["tokens"] and failed["checksums"] == first["checksums"]
    assert failed["weight_version"] == "step-0"
    # a new init and refit afterwards succeeds
    _assert_refit_equals_fresh(served, _run(served, tmp_path, "collective", 2, 1))


@pytest.mark.kills_shared_server
def test_the_server_dies_mid_update_every_trainer_process_raises(servers, tmp_path):
    served = servers.fresh("dense-tp1")  # killed here: this test runs after every other of the directory
    timeout = 10.0
    out = tmp_path / "trainer.json"
    job = {"tiny": {}, "tp": 2, "url": served.client.url, "server_tp": 1, "checkpoint": str(served.a),
           "transport": "collective", "steps": 2, "out": str(out), "prompts": PROMPTS,
           "fault": "kill-server-1", "server_pid": served.process.pid, "options": {"timeout": timeout},
           "timeout": 3 * timeout}
    t0 = time.monotonic()
    run_ranks(2, refit_server, job, timeout=300, errdir=str(tmp_path), wait_all=True)
    result = json.loads(out.read_text())
    assert "exception" not in result, result["exception"]
    first, failed = result["refits"]
    assert "error" not in first and "error" in failed
    assert failed["seconds"] < timeout + 15, f"the trainer raised only after {failed['seconds']:.0f} s"
    assert time.monotonic() - t0 < 300
    rank1 = out.with_suffix(".rank1.json")
    assert not rank1.exists(), rank1.read_text()  # the other process raised ExecutionError too, and returned
    assert not served.process.alive()
