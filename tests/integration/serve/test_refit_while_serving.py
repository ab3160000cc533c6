"""Refits while a real `vllm serve` keeps generating (issue 40): the vLLM CPU build, TP 2, the `reshard` backend,
a loader install with `RefitSpec(staging="device")` and `TrainerSession(pause_for="flip")`; a bounded request
loop streams completions the whole time (harness.serving_load).

Ground truth: the server starts on checkpoint B (its fresh greedy tokens, and the digests of B's tensor files);
the trainer (this process, one rank, plain tensors) holds A, then B. Each refit must leave the server serving
the new weights whole: refit A changes the tokens, refit B gives the fresh server's tokens again and every worker
landed B's bytes exactly.
  keep   the requests in flight across the flip finish (none fails); the engine generated tokens while the bytes
         landed; the pause is a fraction of the refit; the driver reports the requests in flight.
  abort  the requests in flight at the pause end with the engine's own abort, none hangs; the refit succeeds.
  no pause (pause=None): vLLM runs the install's worker RPC between two scheduler steps, on every worker in the
         same order, so the streams go on across the flip on the new weights: none fails, the server equals the
         fresh one on B afterwards, every worker landed B's bytes exactly.
  a failure before the flip (the trainer never sends: the workers' staged transfer times out) -> the refit
         raises, the engine never paused and still serves the previous version, untouched; the next init +
         refit works.
  a flip for a version that did not land (install without a transfer) -> refused with the engine's error naming
         it, the previous weights still served.
  a flip that fails partway (one worker's install raises, $RESHARD_TEST_FLIP_FAULT; the other installed: a mix)
         -> the refit raises naming it, the engine stays paused and refuses generation and /resume, naming the
         torn version; the next complete refit lifts the fence and the server equals a fresh one on its weights.
         The same through the worker extension's /collective_rpc (ExtensionClient, no lease).
  a worker killed inside its flip ($RESHARD_TEST_FLIP_FAULT "1 kill": SIGKILL once it wrote its live weights)
         -> vLLM's engine core dies with its worker: the refit raises naming the server, no token is answered
         afterwards (every request fails, the server exits): the fence is the dead engine, an operator restarts
         it. Last: it consumes the module's server (a second server start costs a minute of CI's 2 cores).
"""
from __future__ import annotations

import time

import pytest

import reshard
from reshard.adapters.refit import RefitSpec
from reshard.adapters.server import ExtensionClient
from reshard.adapters.trainer import TrainerSession
from reshard.adapters.vllm.lease import TORN
from reshard.errors import ExecutionError
from reshard.executors import shard
from reshard.executors.checksum import tensor_digests
from reshard.testing.megatron_cpu import TinyGPT
from harness.serve import ServerProcess, vllm_cpu_python
from harness.serve_jobs import load_checkpoint, make_checkpoint, save_checkpoint, train_step
from harness.serving_load import RequestLoop

pytestmark = pytest.mark.crossprocess

PROMPTS = [[1, 2, 3, 4, 5], [17, 40, 3, 99]]
EXTENSION = ("--worker-extension-cls", "reshard.adapters.vllm.worker.ReshardWorkerExtension")
TINY = TinyGPT(hidden_size=256, ffn_hidden_size=512, num_layers=4)  # enough bytes that the transfer is seen


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if vllm_cpu_python() is None:
        pytest.fail("no vLLM CPU virtualenv (scripts/bootstrap vllm makes .venv-vllm-cpu; scripts/test runs it)")
    work = tmp_path_factory.mktemp("while-serving")
    a = make_checkpoint(TINY, work / "A")
    b = save_checkpoint({k: train_step(v, 1) for k, v in load_checkpoint(a).items()}, a, work / "B")
    fault = work / "flip-fault"  # holds the rank whose flip raises, while it exists (session._injected_flip_fault)
    process = ServerProcess(b, tp=2, log=work / "server.log", extra_args=EXTENSION,
                            env={"RESHARD_TEST_FLIP_FAULT": str(fault)})
    with process as server:
        yield {"server": server, "a": a, "b": b, "fresh": server.greedy(PROMPTS), "fault": fault, "process": process}


def _session(served, pause: str | None, engine=None, **kwargs) -> tuple[TrainerSession, dict]:
    spec = reshard.ModelSpec.from_hf_config(served["a"])
    src = reshard.MegatronLayout(model=spec, vocab_divisor=64)
    refit = RefitSpec.of(spec, src, reshard.VllmLayout(model=spec, tp=2), install="loader", transport="collective",
                         staging="device", options={"timeout": 20})
    tensors = shard(src, load_checkpoint(served["a"]))[0]
    session = TrainerSession(refit, 0, tensors, engines=[engine or served["server"]], pause=pause, pause_for="flip",
                             timeout=120.0, **kwargs)
    session.init()
    return session, tensors


def _load(tensors: dict, src_checkpoint, spec_checkpoint) -> None:
    spec = reshard.ModelSpec.from_hf_config(spec_checkpoint)
    mine = shard(reshard.MegatronLayout(model=spec, vocab_divisor=64), load_checkpoint(src_checkpoint))[0]
    for name, t in tensors.items():
        t.copy_(mine[name])


def _refit_under_load(session: TrainerSession, server, version: str) -> tuple:
    # staggered: at any moment some client's request is running in the engine (lock-stepped clients can all be
    # between requests when the pause lands, and then the engine holds none for "keep" to report)
    with RequestLoop(server.url, server.model(), clients=3, max_tokens=48, timeout=60.0, stagger=0.3) as loop:
        time.sleep(1.0)  # requests in flight before the refit begins
        t0 = time.perf_counter()
        result = session.refit(version)
        time.sleep(0.5)
    return result, loop, t0


def test_keep_then_abort_the_flip_pauses_and_requests_end_as_their_mode_says(served):
    server = served["server"]
    session, tensors = _session(served, "keep")
    try:
        result, loop, t0 = _refit_under_load(session, server, "a-keep")
        assert server.weight_info() == "a-keep" and server.greedy(PROMPTS) != served["fresh"]
        stats = server.collective_rpc("reshard_stats")  # a CPU engine's flip swaps a shadow in (adapters.vllm.staging)
        assert all(w["swap"] for w in stats), stats
        phases = result.phases
        landing = (t0 + phases["start"], t0 + phases["start"] + phases["transfer"] + phases["staged"])
        paused = t0 + result.seconds - result.stats.pause_s
        assert loop.tokens_between(*landing) > 0, "the engine generated nothing while the bytes landed"
        assert result.stats.pause_s < result.seconds, result.phases
        failed = [r for r in loop.requests if r.error]
        assert not failed, f"keep: requests failed: {[r.error for r in failed][:3]}"
        # in flight when the driver paused: each finished whole (held across the pause, or done before the engine
        # served the pause), none aborted. (Not "ended after the refit returned": a held request with a token or
        # two left ends as soon as the engine resumes, which on a loaded machine can be seconds before the driver's
        # resume call returns: a run beside four other heavy jobs on this 2-core machine saw every held request end in
        # that gap.)
        at_pause = loop.spanning(paused, paused)
        assert at_pause and all(r.finish_reason == "length" for r in at_pause), "keep: the flip's requests must finish"
        assert result.stats.in_flight, "the driver did not see the requests held across the flip"
        assert all(r.end for r in loop.requests)  # none hangs

        session.pause_mode = "abort"
        _load(tensors, served["b"], served["a"])
        result, loop, t0 = _refit_under_load(session, server, "b-abort")
        assert server.weight_info() == "b-abort" and server.greedy(PROMPTS) == served["fresh"]
        want = tensor_digests(load_checkpoint(served["b"]))
        assert all(w["installed"] and w["digests"] == want for w in server.landed())
        paused = t0 + result.seconds - result.stats.pause_s
        at_pause = loop.spanning(paused, paused)  # in flight when the pause began: aborted by the engine
        assert all(r.end for r in loop.requests), "abort: a request hangs"
        assert at_pause and all(r.end < t0 + result.seconds + 5.0 for r in at_pause)
        # the engine aborts what runs when its /pause is served, which on a loaded machine can be a second or more
        # after the driver's call (requests ending meanwhile finish whole): one in flight during the pause is aborted
        during = [r for r in loop.requests if r.start < t0 + result.seconds and (r.end == 0.0 or r.end > paused)]
        aborted = [r for r in during if r.finish_reason == "abort" or r.error]
        assert aborted, [(r.finish_reason, r.error) for r in during]
        assert not any(r.end > t0 + result.seconds for r in aborted if r.finish_reason == "length")
    finally:
        session.close()


def test_a_failure_before_the_flip_or_a_flip_of_nothing_leaves_the_previous_version(served):
    server = served["server"]
    before, version = server.greedy(PROMPTS), server.weight_info()
    session, tensors = _session(served, "keep")
    try:
        _load(tensors, served["a"], served["a"])

        def never_sends(*args, **kwargs):
            raise ExecutionError("injected: this trainer process failed before sending")

        session.executor.refit = never_sends  # the workers' staged transfer waits, then times out (20 s)
        t0 = time.monotonic()
        with pytest.raises(ExecutionError, match="injected"):
            session.refit("never")
        assert time.monotonic() - t0 < 90
        assert server.weight_info() == version and server.greedy(PROMPTS) == before
        assert not server.call("GET", "/is_paused")["is_paused"], "the engine paused for a refit that never landed"

        # a flip asked for a version that never landed: the engine refuses it, naming why
        session.init()
        refit_id = session.refit_spec.rendezvous["refit_id"]
        server.start_weight_update()
        with pytest.raises(ExecutionError, match="install refused"):
            server.update_weights({"version": "partial", "refit": refit_id, "phase": "install"})
        # (vLLM closed the update when it failed: nothing to finish)
        assert server.weight_info() == version and server.greedy(PROMPTS) == before

        session.init()  # after a failed collective transfer the group is rebuilt
        result = session.refit("a-after-failure")
        assert result.stats.pause_s > 0 and server.weight_info() == "a-after-failure"
    finally:
        session.close()


@pytest.mark.parametrize("lease, pause", [(30.0, "keep"), (None, None)], ids=["leased-keep", "no-lease-no-pause"])
def test_a_flip_that_fails_partway_fences_the_engine_until_a_refit_lands_whole(served, lease, pause):
    """Without a lease the calls are an operator's; without pauses the fence pauses the engine, and resumes it."""
    server, fault = served["server"], served["fault"]
    session, tensors = _session(served, pause, lease=lease)
    try:
        _load(tensors, served["a"], served["a"])
        fault.write_text("1")  # rank 1 raises inside its flip, rank 0 installs A: the engine holds a mix
        try:
            with pytest.raises(ExecutionError, match=f"{TORN}.*stays fenced"):
                session.refit("a-torn")
        finally:
            fault.unlink()
        assert server.lease_state()["torn"] == "a-torn"
        with pytest.raises(ExecutionError, match=f"HTTP 503.*{TORN}.*'a-torn'"):
            server.greedy(PROMPTS[:1])  # refused, never a mixed answer
        with pytest.raises(ExecutionError, match=TORN):
            server.call("POST", "/resume")  # nobody resumes it (an operator's call carries no lease)
        assert server.call("GET", "/is_paused")["is_paused"], "a torn engine must stay paused"

        _load(tensors, served["b"], served["a"])
        session.init()
        result = session.refit("b-after-torn")  # lands whole: the fence lifts, the driver's resume goes through
        assert (result.stats.pause_s > 0) == (pause is not None) and server.lease_state()["torn"] is None
        assert not server.call("GET", "/is_paused")["is_paused"]
        assert server.weight_info() == "b-after-torn" and server.greedy(PROMPTS) == served["fresh"]
        want = tensor_digests(load_checkpoint(served["b"]))
        assert all(w["installed"] and w["digests"] == want for w in server.landed())
    finally:
        session.close()


def test_a_torn_flip_through_the_worker_extension_is_fenced_the_same_way(served):
    """ExtensionClient drives the refit with /collective_rpc (reshard_update), no lease: the middleware reads its
    install as the /update_weights it stands for."""
    server, fault = served["server"], served["fault"]
    session, tensors = _session(served, "keep", engine=ExtensionClient(server))
    try:
        _load(tensors, served["a"], served["a"])
        fault.write_text("1")
        try:
            with pytest.raises(ExecutionError, match=f"{TORN}.*stays fenced"):
                session.refit("a-torn-rpc")
        finally:
            fault.unlink()
        assert server.lease_state()["torn"] == "a-torn-rpc"
        with pytest.raises(ExecutionError, match=f"HTTP 503.*{TORN}.*'a-torn-rpc'"):
            server.greedy(PROMPTS[:1])
        assert server.call("GET", "/is_paused")["is_paused"]

        _load(tensors, served["b"], served["a"])
        session.init()
        session.refit("b-rpc")  # lands whole: the fence lifts
        assert server.lease_state()["torn"] is None and not server.call("GET", "/is_paused")["is_paused"]
        assert server.greedy(PROMPTS) == served["fresh"]
        want = tensor_digests(load_checkpoint(served["b"]))
        assert all(w["installed"] and w["digests"] == want for w in server.landed())
    finally:
        session.close()


def test_a_flip_without_a_pause_keeps_every_stream_going_onto_the_new_weights(served):
    server = served["server"]
    session, tensors = _session(served, None)
    try:
        _load(tensors, served["a"], served["a"])
        result, loop, t0 = _refit_under_load(session, server, "a-nopause")
        assert result.stats.pause_s == 0.0 and server.weight_info() == "a-nopause"
        assert server.greedy(PROMPTS) != served["fresh"]
        # the streams in flight when the flip began (not those spanning all of it: under load a flip can outlast
        # every 48-token request) go on to their full length
        flip_began = t0 + result.seconds - result.phases["flip"]
        across = loop.spanning(flip_began, flip_began)
        assert across and all(r.finish_reason == "length" for r in across), "the streams across the flip must finish"
        assert loop.tokens_between(t0 + result.seconds, float("inf")) > 0, "nothing streamed after the flip"
        loops = [loop]

        _load(tensors, served["b"], served["a"])
        result, loop, t0 = _refit_under_load(session, server, "b-nopause")
        loops.append(loop)
        assert server.weight_info() == "b-nopause" and server.greedy(PROMPTS) == served["fresh"]
        want = tensor_digests(load_checkpoint(served["b"]))
        assert all(w["installed"] and w["digests"] == want for w in server.landed())
        assert not server.call("GET", "/is_paused")["is_paused"]
        requests = [r for each in loops for r in each.requests]
        failed = [r for r in requests if r.error]
        assert not failed, f"no pause: requests failed: {[r.error for r in failed][:3]}"
        assert all(r.end for r in requests)  # none hangs
    finally:
        session.close()


def test_a_worker_killed_inside_its_flip_kills_the_engine_so_nothing_is_answered_from_a_mix(served):
    """Last in the module: the server does not survive it."""
    server, fault, process = served["server"], served["fault"], served["process"]
    session, tensors = _session(served, "keep")
    try:
        _load(tensors, served["a"], served["a"])
        fault.write_text("1 kill")  # rank 1 wrote A into its live weights, then dies before it reports the install
        with RequestLoop(server.url, server.model(), clients=2, max_tokens=48, timeout=60.0) as loop:
            time.sleep(1.0)
            with pytest.raises(ExecutionError, match=f"refit 'a-killed' failed.*{server.url}"):
                session.refit("a-killed")
            raised = time.perf_counter()
            deadline = time.monotonic() + 120.0  # vLLM's worker monitor -> engine core shutdown -> server exit
            while process.alive() and time.monotonic() < deadline:
                with pytest.raises(ExecutionError):
                    server.greedy(PROMPTS[:1])  # never an answer from the mix, while the server still runs
                time.sleep(1.0)
        assert not process.alive(), f"the server outlived its engine core; last lines:\n{process.tail()}"
        assert loop.tokens_between(raised, float("inf")) == 0, "a token was answered after the worker died"
        assert all(r.end for r in loop.requests), "a request hangs on the dead engine"
        assert all(r.error for r in loop.requests if r.start >= raised)
        assert "died unexpectedly" in process.log.read_text(errors="replace")
    finally:
        fault.unlink(missing_ok=True)
        session.close()
