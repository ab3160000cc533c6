"""One trainer-side job of the server tests across two hosts (tests/multihost/test_serve_multihost.py), run on host A
of the test bed against a `vllm serve` on host B: `python serve_job.py JOB.json`. The pytest process cannot reach
host B; this process can, and writes what it saw, as JSON, to JOB.out.json. JOB["action"] is one of:

  fresh        the server's greedy tokens and vLLM's checksums, before any refit (the ground truth of a refit);
  refit        trainer processes (megatron-core, TP 2, gloo on this host) refit the server twice through
               harness.serve_jobs.refit_server: TrainerSession(host=None), so the store's address is discovered;
  unreachable  a one-process trainer whose store binds loopback (`host="127.0.0.1"`): its init must fail at once,
               naming the address, and the server must answer a completion right after, with its weights unchanged;
  stuck        an init whose store is reachable but whose trainer process never joins: completions must answer
               while the server's worker waits; the worker's wait ends at the rendezvous's timeout, is reported at
               the trainer's store, and the next start_weight_update raises it; then a good one-process refit of
               checkpoint JOB["b"] lands.
"""
from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any


def _one_process_trainer(checkpoint: str, weights_of: str, server_tp: int) -> tuple[Any, dict]:
    """A refit from one trainer process holding plain tensors (a Megatron TP 1 layout of `weights_of`'s weights)."""
    import reshard
    from reshard.adapters.refit import RefitSpec
    from reshard.executors import shard
    from harness.serve_jobs import load_checkpoint

    spec = reshard.ModelSpec.from_hf_config(checkpoint)
    src = reshard.MegatronLayout(model=spec, vocab_divisor=64)
    dst = reshard.VllmLayout(model=spec, tp=server_tp)
    refit = RefitSpec.of(spec, src, dst, install="loader", transport="collective", config=checkpoint)
    return refit, shard(src, load_checkpoint(weights_of))[0]


def _timed(fn: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    value = fn()
    return value, time.monotonic() - t0


def fresh(job: dict, server: Any) -> dict:
    return {"tokens": server.greedy(job["prompts"]), "checksums": server.weight_checksums(),
            "version": server.weight_info()}


def refit(job: dict, server: Any) -> dict:
    from reshard.testing.megatron_cpu import run_ranks
    from harness.serve_jobs import refit_server

    out = Path(job["path"]).with_suffix(".trainer.json")
    trainer = {"tiny": {}, "tp": 2, "url": server.url, "server_tp": job["server_tp"], "checkpoint": job["a"],
               "transport": job["transport"], "steps": 2, "out": str(out), "prompts": job["prompts"],
               "worker_stats": True, "options": job.get("options", {}), "timeout": job.get("timeout", 300.0)}
    errdir = Path(job["path"]).with_suffix(".ranks")
    errdir.mkdir(exist_ok=True)
    seconds = run_ranks(2, refit_server, trainer, timeout=600, errdir=str(errdir))
    return {"trainer": json.loads(out.read_text()), "seconds": seconds}


def unreachable(job: dict, server: Any) -> dict:
    from reshard.adapters.trainer import TrainerSession
    from reshard.errors import ExecutionError

    before = server.greedy(job["prompts"])
    spec, tensors = _one_process_trainer(job["a"], job["a"], job["server_tp"])
    session = TrainerSession(spec, 0, tensors, engines=[server], host="127.0.0.1", timeout=job["timeout"])
    out: dict[str, Any] = {"before": before, "version_before": server.weight_info()}
    t0 = time.monotonic()
    try:
        session.init()
        out["init"] = "succeeded"
    except ExecutionError as e:
        out["init"] = str(e)
    out["init_s"] = time.monotonic() - t0
    out["after"], out["greedy_s"] = _timed(lambda: server.greedy(job["prompts"]))  # right after: nothing waits
    out["version_after"] = server.weight_info()
    session.close()
    return out


def stuck(job: dict, server: Any) -> dict:
    from reshard.adapters import rendezvous as rv
    from reshard.adapters.trainer import TrainerSession
    from reshard.errors import ExecutionError

    before = server.greedy(job["prompts"])
    spec, tensors = _one_process_trainer(job["a"], job["a"], job["server_tp"])
    rdv, store = rv.host_store(rv.Rendezvous.new(timeout=job["rendezvous_timeout"]))  # this host's address
    payload = replace(spec, rendezvous=rdv.to_dict(), plan_digest=spec.plan().digest).to_dict()
    out: dict[str, Any] = {"store": rdv.host, "before": before}
    init: dict[str, Any] = {}

    def call_init() -> None:  # on a thread of its own: an init that blocks the engine must not block this job
        t0 = time.monotonic()
        try:
            server.init_weight_transfer_engine(payload)
            init["outcome"] = "returned"
        except ExecutionError as e:
            init["outcome"] = str(e)
        init["seconds"] = time.monotonic() - t0

    caller = threading.Thread(target=call_init, daemon=True)
    started = time.monotonic()
    caller.start()
    # the worker holds its place at the store once its init's quick part is done (trainer process 0 never comes)
    member = f"{rdv.namespace}member/{spec.plan().src.num_ranks}"
    while not store.check([member]) and time.monotonic() - started < job["rendezvous_timeout"]:
        time.sleep(0.05)
    out["worker_joined_s"] = time.monotonic() - started
    # what a client of the server sees while the worker waits at the rendezvous
    out["during"], out["greedy_s"] = _timed(lambda: server.greedy(job["prompts"]))
    out["version_during"], out["weight_info_s"] = _timed(server.weight_info)
    out["greedy_done_s"] = time.monotonic() - started
    out["failure_before_greedy_done"] = rv.failure(store, rdv)  # None: the worker was still waiting
    caller.join(job["rendezvous_timeout"] + 60)
    out["init"] = init
    # the wait ends at the rendezvous's timeout; the worker tells the trainer's store why
    deadline = started + job["rendezvous_timeout"] + 60
    while rv.failure(store, rdv) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    out["failure"], out["failure_s"] = rv.failure(store, rdv), time.monotonic() - started
    t0 = time.monotonic()
    try:
        server.start_weight_update()
        out["start"] = "succeeded"
    except ExecutionError as e:
        out["start"] = str(e)
    out["start_s"] = time.monotonic() - t0
    out["after"] = server.greedy(job["prompts"])
    # a good init and refit afterwards: one trainer process sending checkpoint B's weights
    good, tensors_b = _one_process_trainer(job["a"], job["b"], job["server_tp"])
    session = TrainerSession(good, 0, tensors_b, engines=[server], timeout=job["timeout"])
    try:
        session.init()
        session.refit("stuck-then-good")
        out["recovered"] = {"tokens": server.greedy(job["prompts"]), "version": server.weight_info(),
                            "landed": server.landed(), "rendezvous": session.rendezvous.host}
    finally:
        session.close()
    return out


def main(path: str) -> None:
    from reshard.adapters.server import VllmServer

    job = json.loads(Path(path).read_text())
    job["path"] = path
    out: dict[str, Any] = {}
    try:
        server = VllmServer(job["url"], timeout=job.get("timeout", 300.0))
        out = {"fresh": fresh, "refit": refit, "unreachable": unreachable, "stuck": stuck}[job["action"]](job, server)
    except BaseException as e:  # noqa: BLE001 - the test reads what failed
        out["error"] = f"{type(e).__name__}: {e}"
        out["trace"] = traceback.format_exc()[-4000:]
    Path(path).with_suffix(".out.json").write_text(json.dumps(out, default=str))
    sys.stdout.flush()
    import os

    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
