"""A driver that dies: trainer processes that refit a running vLLM server and whose process 0 (the one that called
init and drives the server) is SIGKILLed at a chosen phase of a refit, for the driver-death tests and benchmark.

Trainer processes hold plain tensors in a Megatron TP layout (reshard.testing.megatron_cpu.run_ranks gives them a gloo
world); process 0 kills itself with SIGKILL (no clean-up runs) at:
  "before"  the server is paused and the update started, no byte sent;
  "during"  the other trainer process sends its bytes while process 0 dies before sending its own: the workers
            are mid-transfer;
  "after"   every engine worker reported the transfer complete; the install step was never sent.
Process 0 writes `killed_at` (time.time()) to `job["out"]` just before it dies; the other process writes what it
saw to `<out>.rank1.json`.
"""
from __future__ import annotations

import json
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any

PHASES = ("before", "during", "after")
TRANSPORTS = ("collective", "shared", "nixl")
# Every (transport, phase) pair, and an each-choice cover of them: every transport and every phase once, so a
# run that cannot afford nine lease waits still kills the driver on each transport and in each phase.
ALL_CASES = tuple((t, p) for t in TRANSPORTS for p in PHASES)
EACH_CHOICE = tuple(zip(TRANSPORTS, PHASES))
# Seconds between the tests' asks for a token while the engine may still be paused (kill_the_driver says why not
# 0.1 s, the benchmark's).
TESTS_ASK_EVERY = 2.0


def driver_death_cases() -> list:
    """The driver-death tests' parametrization: all nine (transport, phase) pairs, a slow test; with the slow tests
    left out (RESHARD_SLOW_TESTS=0, scripts/test), an each-choice cover of them instead (each transport and each
    phase once: three lease waits), which the nine contain."""
    import pytest

    if os.environ.get("RESHARD_SLOW_TESTS") == "0":
        return [pytest.param(EACH_CHOICE, id="each-choice")]
    return [pytest.param(ALL_CASES, id="all", marks=pytest.mark.slow)]


def _die(out: Path, phase: str) -> None:
    part = out.with_suffix(".part")  # whole or absent: the test reads `out` as soon as it exists
    part.write_text(json.dumps({"killed_at": time.time(), "phase": phase}))
    os.replace(part, out)
    os.kill(os.getpid(), signal.SIGKILL)


def dying_driver(job: dict[str, Any]) -> None:
    """On every trainer rank: init, then one refit during which process 0 is SIGKILLed at `job["phase"]`."""
    import torch.distributed as dist

    from reshard.adapters.refit import RefitSpec
    from reshard.adapters.trainer import TrainerSession
    from reshard.errors import ExecutionError
    from reshard.executors import shard
    from reshard.layouts import MegatronLayout, ModelSpec, VllmLayout
    from .serve_jobs import load_checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    out, phase = Path(job["out"]), job["phase"]
    spec = ModelSpec.from_hf_config(job["checkpoint"])
    src = MegatronLayout(model=spec, tp=world, vocab_divisor=64)
    tensors = shard(src, load_checkpoint(job["checkpoint"]), ranks=[rank])[rank]
    refit = RefitSpec.of(spec, src, VllmLayout(model=spec, tp=job["engine"]["tp"]), install="loader",
                         transport=job["transport"], options={"timeout": job["timeout"]}, config=job["checkpoint"])
    server = engine_client(job["engine"], job["timeout"] * 3) if rank == 0 else None
    session = TrainerSession(refit, rank, tensors, engines=[server] if server else [],
                             trainer_group=dist.group.WORLD, timeout=job["timeout"], lease=job["lease"])
    seen: dict[str, Any] = {}
    try:
        session.init()
        if rank == 0 and phase == "before":
            start = server.start_weight_update

            def start_then_die() -> None:
                start()
                _die(out, phase)

            server.start_weight_update = start_then_die
        elif rank == 0 and phase == "after":
            update = server.update_weights

            def die_before_install(info: Any) -> None:
                if isinstance(info, dict) and info.get("phase") == "install":
                    _die(out, phase)
                update(info)

            server.update_weights = die_before_install
        elif phase == "during":
            executor_refit = session.executor.refit

            def send_or_die() -> Any:
                if rank == 0:
                    time.sleep(0.5)  # the other process's bytes are on their way: the workers are mid-transfer
                    _die(out, phase)
                return executor_refit()

            session.executor.refit = send_or_die
        session.refit(job["version"])
        seen["refit"] = "succeeded"
    except ExecutionError as e:
        seen["refit"] = f"raised: {e}"
    except Exception:  # noqa: BLE001 - reported to the test
        seen["exception"] = traceback.format_exc()
    finally:
        session.close()
    # process 0 gets here only if it was not killed: what it saw tells why (the test reports every rank's file)
    out.with_suffix(f".rank{rank}.json").write_text(json.dumps(seen))


def engine_client(engine: dict[str, Any], timeout: float) -> Any:
    """The client of an engine described as JSON: {"url", "tp"} (a vLLM server) or {"ray_address", "namespace",
    "name", "tp"} (a named VllmEngineActor of a running Ray cluster; this process joins it)."""
    if "url" in engine:
        from reshard.adapters.server import VllmServer

        return VllmServer(engine["url"], timeout=timeout)
    import ray

    from reshard.adapters.ray import RayEngineClient

    if not ray.is_initialized():
        ray.init(address=engine["ray_address"], namespace=engine["namespace"], log_to_driver=False)
    return RayEngineClient(ray.get_actor(engine["name"]), engine["name"], timeout=timeout)


def _await_lease_ended(engine: dict[str, Any], deadline: float) -> None:
    """Wait (until `deadline`) for the engine to end a lapsed lease and close what its driver left open."""
    from reshard import polling

    client = engine_client(engine, 30.0)
    polling.poll(lambda: client.lease_state()["holder"] is None, deadline, first_s=0.2, most_s=0.2)


LAPSED_BEFORE_THE_KILL = "is not the server's current lease"  # the engine's refusal of a fenced driver's call


def refit_from_here(engine: dict[str, Any], checkpoint: str | Path, transport: str, version: str,
                    timeout: float = 60.0, lease: float = 30.0, lapses: int = 1) -> float:
    """A new driver: one trainer process (this one, plain tensors in a Megatron TP1 layout) inits and refits the
    engine with `checkpoint`; returns time.time() when the refit succeeded (raises ExecutionError otherwise).

    A refit the engine refused because this driver's lease lapsed is run again by a new driver, `lapses` times, once
    the engine has ended that lease: on a loaded 2-core machine the driver and its keeper process were seen to stall
    for the whole lease (no renewal reached the engine in 30 s), and the engine then fences the driver, as it must;
    that the fenced refit leaves the engine its weights is what kill_the_driver's cases check."""
    from reshard.adapters.refit import RefitSpec
    from reshard.adapters.trainer import TrainerSession
    from reshard.errors import ExecutionError
    from reshard.executors import shard
    from reshard.layouts import MegatronLayout, ModelSpec, VllmLayout
    from .serve_jobs import load_checkpoint

    spec = ModelSpec.from_hf_config(checkpoint)
    src = MegatronLayout(model=spec, vocab_divisor=64)
    refit = RefitSpec.of(spec, src, VllmLayout(model=spec, tp=engine["tp"]), install="loader", transport=transport,
                         options={"timeout": timeout}, config=checkpoint)
    session = TrainerSession(refit, 0, shard(src, load_checkpoint(checkpoint))[0],
                             engines=[engine_client(engine, 3 * timeout)], timeout=timeout, lease=lease)
    try:
        session.init()
        session.refit(version)
        return time.time()
    except ExecutionError as e:
        if lapses <= 0 or LAPSED_BEFORE_THE_KILL not in str(e):
            raise
        print(f"refit {version}: the new driver's lease lapsed; a new driver again ({e})"[:400])
    finally:
        session.close()
    _await_lease_ended(engine, time.monotonic() + 2 * lease + timeout)
    return refit_from_here(engine, checkpoint, transport, version, timeout, lease, lapses - 1)


def kill_the_driver(engine: dict[str, Any], checkpoint: str | Path, transport: str, phase: str, *, work: Path,
                    lease: float, timeout: float, prompts: list[list[int]], poll: float = 1.0,
                    ask_every: float = 0.1, early_lapses: int = 1) -> dict[str, Any]:
    """One case: two trainer processes refit the engine (see engine_client) with `checkpoint` as version
    "dead-<phase>", process 0 is SIGKILLed at `phase`; then this process asks the engine for one token (each ask
    waits at most `poll` s; `ask_every` s between asks) until it serves again. Returns {"killed_at", "serving_at",
    "tokens" (greedy tokens of `prompts` then), "ended_at" (when the engine had ended the dead driver's lease),
    "weight_version", "lease" (the engine's lease state), "rank1" (what the surviving trainer process saw),
    "ranks"}.

    Every ask that reaches a paused vLLM engine wakes its workers, which then spin (vLLM's shared-memory queue polls
    for a second after each message): asked every 0.1 s, a TP 2 server's workers took two cores for the whole lease
    wait (measured, ~19 CPU-s each per case); every 2 s, about half. The benchmark asks often (its figure is when the
    engine served again); the tests, whose bound is tens of seconds, ask every TESTS_ASK_EVERY s.

    A case whose live driver was fenced before its phase came (its lease lapsed while the keeper process starved on
    a loaded machine: the test's comment on its lease says how often) killed no driver: it runs again, at most
    `early_lapses` times, once the engine has ended that lease."""
    import threading

    from reshard.errors import ExecutionError
    from reshard.testing.megatron_cpu import run_ranks

    work.mkdir(parents=True, exist_ok=True)
    out = work / f"driver-{transport}-{phase}.json"
    job = {"out": str(out), "phase": phase, "checkpoint": str(checkpoint), "engine": engine,
           "transport": transport, "timeout": timeout, "lease": lease, "version": f"dead-{phase}"}
    ranks: dict[str, Any] = {}

    def run() -> None:
        try:
            ranks["s"] = run_ranks(2, dying_driver, job, timeout=6 * timeout + 120, errdir=str(work), wait_all=True)
        except Exception as e:  # noqa: BLE001 - reported below
            ranks["error"] = f"{type(e).__name__}: {e}"

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 6 * timeout + 120
    while not out.exists() and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not out.exists():
        thread.join(30)
        seen = {f.name: f.read_text()[:2000] for f in sorted(work.glob(f"{out.stem}.rank*.json"))}
        if early_lapses > 0 and any(LAPSED_BEFORE_THE_KILL in text for text in seen.values()):
            # the live driver's lease lapsed before the phase came (its keeper starved on a loaded machine: the
            # engine fenced it, the refit failed cleanly): no driver died, so the case has not run; run it again
            print(f"driver death {transport}/{phase}: the lease lapsed before the kill; running the case again")
            _await_lease_ended(engine, deadline)
            return kill_the_driver(engine, checkpoint, transport, phase, work=work / "again", lease=lease,
                                   timeout=timeout, prompts=prompts, poll=poll, ask_every=ask_every,
                                   early_lapses=early_lapses - 1)
        raise RuntimeError(f"the driver was not killed at {phase!r}: {ranks}; the trainer processes saw: "
                           f"{seen or 'nothing (none wrote its file: killed or crashed)'}")
    killed_at = json.loads(out.read_text())["killed_at"]
    poller = engine_client(engine, poll)
    serving_at = None
    while time.monotonic() < deadline:
        try:  # one token of one prompt: answered at once by a serving engine, never by a paused one
            poller.greedy(prompts[:1], max_tokens=1)
            serving_at = time.time()
            break
        except ExecutionError:
            time.sleep(ask_every)
    client = engine_client(engine, 120.0)
    ended_at = None  # when the engine had ended the dead driver's lease (an offline engine serves meanwhile)
    while time.monotonic() < deadline:
        if client.lease_state()["holder"] is None:
            ended_at = time.time()
            break
        time.sleep(0.1)
    thread.join(max(1.0, deadline - time.monotonic()))
    tokens = client.greedy(prompts)
    version = weight_version(client)
    rank1 = out.with_suffix(".rank1.json")
    return {"killed_at": killed_at, "serving_at": serving_at, "ended_at": ended_at, "tokens": tokens,
            "weight_version": version, "lease": client.lease_state(),
            "rank1": json.loads(rank1.read_text()) if rank1.exists() else None, "ranks": ranks}


def weight_version(client: Any) -> str | None:
    """The weight version an engine client reports (a vLLM server's `weight_info`, an engine actor's
    `weight_version`)."""
    return client.weight_info() if hasattr(client, "weight_info") else client.weight_version()


def check_death_cases(engine: dict[str, Any], client: Any, a: Path, b: Path, cases: list, *, work: Path,
                      lease: float, timeout: float, margin: float, prompts: list[list[int]], until: str) -> None:
    """Run `cases` ((transport, phase) pairs, kill_the_driver each) on an engine serving checkpoint `b` fresh, its
    refits alternating between `a` and `b`, so every case both keeps and then changes the served weights. Each must
    leave the engine serving (and `until`, "serving_at" or "ended_at", reached within lease + timeout + margin of
    the kill) its previous weights (the same greedy tokens) and version, the lease ended, the surviving trainer
    process without an exception; a new driver's refit (refit_from_here) must then land within 3 timeouts +
    margin: the other checkpoint's tokens, its version, and reshard's digest of every tensor that landed on every
    worker (before vLLM repacks it) equal to the checkpoint file's."""
    from reshard.executors.checksum import tensor_digests
    from .serve_jobs import load_checkpoint

    digests = {c: tensor_digests(load_checkpoint(c)) for c in (a, b)}  # the checkpoints' files: ground truth
    tokens = {b: client.greedy(prompts)}
    served, version = b, weight_version(client)
    for transport, phase in cases:
        other = a if served == b else b
        case = kill_the_driver(engine, other, transport, phase, work=work, lease=lease, timeout=timeout,
                               prompts=prompts, ask_every=TESTS_ASK_EVERY)
        label = f"{transport}/{phase}"
        assert case["serving_at"] is not None and case[until] is not None, (label, case)
        took = case[until] - case["killed_at"]
        assert took < lease + timeout + margin, f"{label}: {until} only {took:.1f} s after the kill"
        assert case["tokens"] == tokens[served], f"{label}: the engine does not serve its previous weights"
        assert case["weight_version"] == version, f"{label}: version {case['weight_version']!r}"
        assert case["lease"]["holder"] is None, f"{label}: the dead driver still holds the lease"
        assert case["rank1"] is not None and "exception" not in case["rank1"], (label, case)
        t0 = time.monotonic()
        refit_from_here(engine, other, transport, f"new-{transport}-{phase}", timeout=timeout)
        served, version = other, f"new-{transport}-{phase}"
        now = client.greedy(prompts)
        assert now != tokens[b] if served == a else now == tokens[b], f"{label}: the new driver's refit"
        tokens.setdefault(served, now)
        assert now == tokens[served] and weight_version(client) == version
        for worker in client.landed():  # reshard's digest of every tensor that landed, before repacking
            assert worker["installed"] and worker["digests"] == digests[served], f"{label}: landed bytes"
        assert time.monotonic() - t0 < 3 * timeout + margin


__all__ = ["ALL_CASES", "EACH_CHOICE", "PHASES", "TESTS_ASK_EVERY", "TRANSPORTS", "check_death_cases",
           "driver_death_cases", "dying_driver", "engine_client", "kill_the_driver", "refit_from_here",
           "weight_version"]
