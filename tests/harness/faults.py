"""The fault matrix: {source process killed, destination process killed, peer frozen past the timeout, one byte
corrupted in flight} x {gloo (the torch.distributed executor over a store-made group), NIXL, shared memory}, on
CPU, in spawned processes that meet through a TCPStore the parent holds.

One case, three processes: process 0 plays source rank 0, process 1 source rank 1 and destination rank 0, process
2 destination rank 1. Every process refits once (refit 1), puts new weights into its sources and waits; the
parent lets them start refit 2, in which the victim dies, freezes or corrupts a byte at a point inside the refit
(gloo: when it reaches round 1; NIXL: when it posts its first transfer or votes; shared memory: when it signals
its first copy done or votes; a corrupted byte: on the wire after the sender hashed it). Every survivor records
what refit 2 raised, after how long, and whether its destinations still hold refit 1's bytes. Then the parent
replaces a dead or frozen victim with a fresh process, and every process builds a fresh executor (a new
namespace) and refits again; each compares its destinations with the local executor's, byte for byte.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from .clock import OwnClock

KINDS = ("gloo", "nixl", "shared")
FAULTS = ("src_killed", "dst_killed", "frozen", "corrupt")
VICTIM = {"src_killed": 0, "dst_killed": 2, "frozen": 2, "corrupt": 0}
PROCESSES = 3
SENTINEL = -7.0


def fault_plan(path: Path) -> Path:
    """A small plan with several rounds and links: Megatron TP2 -> two vLLM TP1 replicas (bfloat16)."""
    import reshard

    spec = reshard.ModelSpec(family="qwen3", hidden_size=64, num_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=300, qk_norm=True)
    plan = reshard.compile(reshard.MegatronLayout(model=spec, tp=2), reshard.VllmLayout(model=spec, replicas=2))
    return plan.save(path)


def binding() -> Any:
    from reshard.executors.binding import Binding

    return Binding((0, 1), (1, 2))


def make_executor(kind: str, plan: Any, process: int, src: dict, dst: dict, store: Any, namespace: str,
                  timeout: float, checksum: bool | str, setup_timeout: float | None = None) -> Any:
    """The `kind` executor of this process over the store, under `namespace`. `setup_timeout`: how long the gloo
    group's set-up waits for every member (default: at least 60 s, for a replacement process to start)."""
    import torch.distributed as dist

    if kind == "gloo":
        from reshard.executors.collective.comm import StoreComm
        from reshard.executors.collective.executor import CollectiveExecutor

        # the group's own set-up waits for every member, a replacement too (seconds to start): not the refit's timeout
        comm = StoreComm(dist.PrefixStore(f"{namespace}/", store), process, PROCESSES, "gloo",
                         max(timeout, 60.0) if setup_timeout is None else setup_timeout)
        return CollectiveExecutor(plan, binding(), process, src, dst, group=comm, timeout=timeout,
                                   checksum=checksum, bucket_bytes=1024, direct_bytes=None)
    if kind == "nixl":
        from reshard.executors.nixl import NixlExecutor, NixlOptions

        return NixlExecutor(plan, binding(), process, src, dst, store=store, namespace=namespace,
                            options=NixlOptions(timeout=timeout, checksum=checksum))
    from reshard.executors.shared import SharedExecutor

    return SharedExecutor(plan, binding(), process, src, dst, store=store, namespace=namespace, timeout=timeout,
                          checksum=checksum)


def _weights(model: Any, seed: int) -> dict[str, torch.Tensor]:
    from reshard.executors.reference import torch_dtype

    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=g).to(torch_dtype(model.dtype)) for t in model.tensors}


def _load(plan: Any, src: dict, seed: int) -> dict:
    """Shard the weights of `seed` into this process's source tensors; return every rank's (for the reference)."""
    from reshard.executors.reference import shard

    full = shard(plan.src, _weights(plan.src.model, seed))
    for r, ts in src.items():
        for n, t in ts.items():
            t.copy_(full[r][n])
    return full


def _matches(plan: Any, full: dict, dst: dict) -> bool:
    from reshard.executors.reference import allocate, execute_local

    want = allocate(plan.dst, fill=SENTINEL)
    execute_local(plan, full, want)
    return all(torch.equal(t.view(torch.uint8), want[r][n].view(torch.uint8)) for r, ts in dst.items()
               for n, t in ts.items())


# --- what the victim does ---------------------------------------------------------------------------------------

def _stop(action: str) -> None:
    if action == "kill":
        os._exit(17)
    os.kill(os.getpid(), signal.SIGSTOP)  # frozen until the parent kills it
    time.sleep(3600)


def _flip(t: torch.Tensor) -> None:
    b = t.reshape(-1).view(torch.uint8)
    b[0] ^= 1


def arm(kind: str, fault: str, ex: Any) -> Callable[[], None]:
    """Make the victim's executor fail refit 2 as `fault` says; returns what undoes it (for the corrupt case,
    whose victim survives)."""
    action = "kill" if fault.endswith("killed") else "freeze"
    if kind == "gloo":
        if fault != "corrupt":
            ex.on_round = lambda index: _stop(action) if index >= 1 else None
            return lambda: None
        from reshard.executors.collective.runners import HostRunner

        original = HostRunner.post
        state = {"done": False}

        def post(self: Any, pos: int) -> Any:  # after pack hashed the bytes: flip one on the wire
            if not state["done"] and self.b.send_bufs[pos]:
                _flip(self.b.send_bufs[pos][0])
                state["done"] = True
            return original(self, pos)

        HostRunner.post = post
        return lambda: setattr(HostRunner, "post", original)
    if fault != "corrupt":
        exchange = ex.exchange
        vote = exchange.vote
        exchange.vote = lambda v: _stop(action)
        if kind == "shared":
            signal_ = exchange.signal
            exchange.signal = lambda key: (signal_(key), _stop(action)) if "/done/" in key else signal_(key)
        else:
            post = ex.connection.post
            ex.connection.post = lambda link, message: (post(link, message), _stop(action))
        return lambda: setattr(exchange, "vote", vote)
    if kind == "shared":
        q, program = next(iter(ex._send_programs.items()))
        landing = next(t for (peer, _), t in ex._peer_landing.items() if peer == q)

        class Corrupting:
            def run(self) -> None:
                program.run()
                _flip(landing)  # in the receiver's memory, after the copy; the sender hashes its source

            def __len__(self) -> int:
                return len(program)

        ex._send_programs[q] = Corrupting()
        return lambda: None
    digest = ex._link_digest
    once = {"done": False}

    def corrupting(link: Any, side: str) -> str:
        out = digest(link, side)
        if side == "send" and not once["done"]:
            once["done"] = True
            p = link.pieces
            _flip(ex._memory(int(p["send_kind"][0]), int(p["send_id"][0])).narrow(0, int(p["send_off"][0]), 1))
        return out

    ex._link_digest = corrupting
    return lambda: None


# --- the processes -------------------------------------------------------------------------------------------

def worker(process: int, port: int, workdir: str, replacement: bool = False) -> None:
    """One process of a case (workdir/case.json); writes workdir/result-<process>[-new].json."""
    import torch.distributed as dist

    from reshard.executors.reference import allocate, shard
    from reshard.planner import Plan

    torch.set_num_threads(1)
    case = json.loads((Path(workdir) / "case.json").read_text())
    kind, fault, timeout, checksum = case["kind"], case["fault"], case["timeout"], case.get("checksum", True)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    plan, b = Plan.load(case["plan"]), binding()
    src = shard(plan.src, _weights(plan.src.model, 1), ranks=list(b.src_ranks_of(process)))
    dst = allocate(plan.dst, fill=SENTINEL, ranks=list(b.dst_ranks_of(process)))
    out: dict[str, Any] = {"process": process, "replacement": replacement}
    try:
        if not replacement:
            ex = make_executor(kind, plan, process, src, dst, store, "first", timeout, checksum=checksum)
            ex.refit()
            out["refit1"] = _matches(plan, _load(plan, src, 1), dst)
            after_first = {r: {n: t.clone() for n, t in ts.items()} for r, ts in dst.items()}
            _load(plan, src, 2)
            undo = arm(kind, fault, ex) if process == VICTIM[fault] else (lambda: None)
            store.set(f"ready/{process}", b"1")
            store.wait(["go"])
            clock = OwnClock()
            try:
                ex.refit()
                out["error"] = None
            except Exception as e:  # noqa: BLE001 - the test checks the type and the words
                out["error"] = f"{type(e).__name__}: {e}"
            out["seconds"], out["wall_seconds"] = clock.seconds(), clock.wall()  # own time: queueing excluded
            out["unchanged"] = all(torch.equal(t, after_first[r][n]) for r, ts in dst.items() for n, t in ts.items())
            undo()
            ex.close()
            store.set(f"failed/{process}", b"1")
            store.wait(["recover"])
        # a replacement takes seconds to start: the fresh executor's set-up waits longer than a refit may
        ex2 = make_executor(kind, plan, process, src, dst, store, "second", 60.0, checksum=checksum)
        full = _load(plan, src, 3)
        ex2.refit()
        out["recovered"] = _matches(plan, full, dst)
        ex2.close()
    except Exception:  # noqa: BLE001 - reported to the test
        out["crash"] = traceback.format_exc(limit=6)
    suffix = "-new" if replacement else ""
    (Path(workdir) / f"result-{process}{suffix}.json").write_text(json.dumps(out))


def run_case(kind: str, fault: str, workdir: Path, timeout: float, limit: float = 120.0,
             checksum: bool | str = True) -> list[dict[str, Any]]:
    """Run one case of the matrix; the results of every process (the victim's replacement included).
    `checksum`: the executors' checksum option (executors.checksum)."""
    import torch.distributed as dist

    workdir.mkdir(parents=True, exist_ok=True)
    plan = fault_plan(workdir / "plan.npz")
    (workdir / "case.json").write_text(json.dumps({"kind": kind, "fault": fault, "timeout": timeout,
                                                   "plan": str(plan), "checksum": checksum}))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = context()
    procs = [ctx.Process(target=worker, args=(p, store.port, str(workdir)), daemon=True) for p in range(PROCESSES)]
    victim = VICTIM[fault]
    for p in procs:
        p.start()
    extra: list[Any] = []
    try:
        _wait(store, [f"ready/{p}" for p in range(PROCESSES)], procs, limit)
        store.set("go", b"1")
        survivors = [p for p in range(PROCESSES) if p != victim or fault == "corrupt"]
        _wait(store, [f"failed/{p}" for p in survivors], [procs[p] for p in survivors], limit)
        if fault != "corrupt":
            procs[victim].kill()  # SIGKILL unless it has ended (a victim ending between a check and a kill is no error)
            procs[victim].join(10)
            extra.append(ctx.Process(target=worker, args=(victim, store.port, str(workdir), True), daemon=True))
            extra[-1].start()
        store.set("recover", b"1")
        end = time.monotonic() + limit
        for p in procs + extra:
            p.join(max(0.0, end - time.monotonic()))
    finally:
        for p in procs + extra:
            if p.is_alive():
                p.kill()
                p.join(5)
    results = []
    for f in sorted(workdir.glob("result-*.json")):
        results.append(json.loads(f.read_text()))
    return results


def context() -> Any:
    """Processes forked from a server that imported torch and reshard once: a fresh process in a fraction of a
    second instead of seconds (spawn re-imports everything each time; a plain fork would copy the parent's
    threads and store connections)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "reshard", "reshard.executors.collective.executor",
                                "harness.faults"])
    return ctx


def _wait(store: Any, keys: list[str], procs: list[Any], limit: float) -> None:
    """Wait for the keys; give up (the results say why) once a process that should set one has exited."""
    end = time.monotonic() + limit
    while not store.check(keys):
        if time.monotonic() > end or any(p.exitcode is not None for p in procs):
            return
        time.sleep(0.02)


__all__ = ["FAULTS", "KINDS", "VICTIM", "arm", "fault_plan", "make_executor", "run_case", "worker"]
