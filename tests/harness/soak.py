"""Soak: many consecutive refits of a tiny model between two CPU processes, and refits interrupted at random
points, with what each process holds sampled along the way (resident memory, open file descriptors, threads)
and, by the parent, the /dev/shm segments and the store's keys. Leaks show as counts that grow with the refits.

Process 0 plays the source rank, process 1 the destination rank. Phase 1 builds one executor and refits
`refits` times (new weights each time, every refit checked against the local executor every `check_every`).
Phase 2 repeats `interrupts` times: a fresh executor (a new namespace; for gloo a new group over the store),
one refit in which one process raises at a random step (a random call of one of the executor's internal steps,
chosen by a seeded generator), both processes close what they built; the resources are sampled after each.
"""
from __future__ import annotations

import gc
import json
import os
import random
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from .faults import _load, _matches, _weights, context
from .shm import left_behind, segments

PAGE = os.sysconf("SC_PAGE_SIZE")


class Interrupt(Exception):
    """Raised inside a refit by the soak's fault injection."""


def resources() -> dict[str, int]:
    """This process's resident memory (bytes), open file descriptors and threads (the kernel's count)."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * PAGE
    with open("/proc/self/status") as f:
        threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    return {"rss": rss, "fds": len(os.listdir("/proc/self/fd")), "threads": threads}


def tiny_plan(path: Path) -> Path:
    import reshard

    spec = reshard.ModelSpec(family="qwen3", hidden_size=32, num_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=100, qk_norm=True)
    return reshard.compile(reshard.MegatronLayout(model=spec, tp=1), reshard.VllmLayout(model=spec)).save(path)


def _executor(kind: str, plan: Any, process: int, src: dict, dst: dict, store: Any, namespace: str,
              timeout: float) -> tuple[Any, Callable[[], None]]:
    """The executor and what releases everything it and its group hold."""
    import torch.distributed as dist

    from reshard.executors.binding import Binding

    binding = Binding((0,), (1,))
    if kind == "gloo":
        from reshard.executors.collective.comm import StoreComm
        from reshard.executors.collective.executor import CollectiveExecutor

        comm = StoreComm(dist.PrefixStore(f"{namespace}/", store), process, 2, "gloo", timeout)
        ex = CollectiveExecutor(plan, binding, process, src, dst, group=comm, timeout=timeout, bucket_bytes=2048)
        return ex, lambda: (ex.close(), comm.close())
    if kind == "nixl":
        from reshard.executors.nixl import NixlExecutor, NixlOptions

        ex = NixlExecutor(plan, binding, process, src, dst, store=store, namespace=namespace,
                          options=NixlOptions(timeout=timeout))
        return ex, ex.close
    from reshard.executors.shared import SharedExecutor

    ex = SharedExecutor(plan, binding, process, src, dst, store=store, namespace=namespace, timeout=timeout)
    return ex, ex.close


def _steps(kind: str, ex: Any) -> list[tuple[Any, str]]:
    """(object, method name) of the steps a refit calls, where an interrupt may strike."""
    if kind == "gloo":
        from reshard.executors.collective.runners import HostRunner

        return [(HostRunner, "pack"), (HostRunner, "post"), (HostRunner, "complete"), (ex, "_agree"),
                (ex, "_preflight")]
    if kind == "nixl":
        return [(ex, "_post"), (ex, "_notify"), (ex, "_arrived"), (ex.exchange, "vote"), (ex, "_run")]
    return [(ex.exchange, "signal"), (ex.exchange, "vote"), (ex.exchange, "wait_count"), (ex.exchange, "wait_all")]


def _interrupting(owner: Any, name: str, after: int) -> Callable[[], None]:
    """Make the `after`-th call of owner.name raise Interrupt; returns what restores it."""
    original = getattr(owner, name)
    count = {"n": 0}

    def hooked(*args: Any, **kwargs: Any) -> Any:
        count["n"] += 1
        if count["n"] == after:
            raise Interrupt(f"interrupted at call {after} of {name}")
        return original(*args, **kwargs)

    setattr(owner, name, hooked)
    return lambda: setattr(owner, name, original) if isinstance(owner, type) else owner.__dict__.pop(name, None)


def worker(process: int, port: int, workdir: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from reshard.executors.reference import allocate, shard
    from reshard.planner import Plan

    import faulthandler

    torch.set_num_threads(1)
    # a crash inside a binding (UCX's assertions abort) or a hang leaves the Python stacks of every thread here
    stacks = open(Path(workdir) / f"stacks-{process}.txt", "w")  # noqa: SIM115 - open until the process ends
    faulthandler.enable(stacks)
    job = json.loads((Path(workdir) / "soak.json").read_text())
    faulthandler.dump_traceback_later(job["limit"] - 10, exit=False, file=stacks)
    kind, store = job["kind"], dist.TCPStore("127.0.0.1", port, is_master=False)
    plan = Plan.load(job["plan"])
    src = shard(plan.src, _weights(plan.src.model, 0), ranks=[0] if process == 0 else [])
    dst = allocate(plan.dst, fill=-7.0, ranks=[0] if process == 1 else [])
    out: dict[str, Any] = {"process": process, "samples": [], "wrong": 0, "interrupts": [], "errors": []}
    try:
        ex, release = _executor(kind, plan, process, src, dst, store, "soak", job["timeout"])
        start = time.monotonic()
        for k in range(job["refits"]):
            full = _load(plan, src, k + 1)
            ex.refit()
            if k % job["check_every"] == 0 or k == job["refits"] - 1:
                out["wrong"] += not _matches(plan, full, dst)
            if k % job["sample_every"] == 0 or k == job["refits"] - 1:
                gc.collect()
                out["samples"].append({"refit": k + 1, **resources(), "store_keys": store.num_keys()})
        out["seconds_per_refit"] = (time.monotonic() - start) / max(job["refits"], 1)
        release()
        rnd = random.Random(job["seed"])
        for i in range(job["interrupts"]):
            victim, pick, after = rnd.randrange(2), rnd.random(), rnd.randint(1, 2)
            name, restore, release = "set-up", (lambda: None), (lambda: None)
            try:
                ex, release = _executor(kind, plan, process, src, dst, store, f"int{i}", job["interrupt_timeout"])
                steps = _steps(kind, ex)
                owner, name = steps[int(pick * len(steps))]
                restore = _interrupting(owner, name, after) if victim == process else restore
                _load(plan, src, i)
                ex.refit()
                outcome = "completed"
            except Exception as e:  # noqa: BLE001 - an interrupted refit raises (or a peer's set-up, when the
                outcome = type(e).__name__  # interrupted one already left); which error is recorded
            restore()
            release()
            store.set(f"int{i}/done/{process}", b"1")
            store.wait([f"int{i}/done/{1 - process}"], timedelta(seconds=job["limit"] / 2))
            gc.collect()
            out["interrupts"].append({"i": i, "step": name, "call": after, "victim": victim, "outcome": outcome,
                                      **resources(), "store_keys": store.num_keys()})
    except Exception as e:  # noqa: BLE001 - reported
        import traceback

        out["errors"].append(f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}")
    (Path(workdir) / f"soak-{process}.json").write_text(json.dumps(out))


def run(kind: str, workdir: Path, refits: int, interrupts: int, timeout: float = 30.0,
        interrupt_timeout: float = 1.0, seed: int = 0, sample_every: int = 50, check_every: int = 25,
        limit: float = 3600.0) -> dict[str, Any]:
    """Run a soak; returns both processes' samples, the /dev/shm segments before and those the soak left (harness.shm),
    and the store's keys."""
    import torch.distributed as dist

    workdir.mkdir(parents=True, exist_ok=True)
    job = {"kind": kind, "plan": str(tiny_plan(workdir / "plan.npz")), "refits": refits,
           "interrupts": interrupts, "timeout": timeout, "interrupt_timeout": interrupt_timeout, "seed": seed,
           "sample_every": sample_every, "check_every": check_every, "limit": limit}
    (workdir / "soak.json").write_text(json.dumps(job))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    shm_before = segments()
    ctx = context()
    procs = [ctx.Process(target=worker, args=(p, store.port, str(workdir)), daemon=True) for p in (0, 1)]
    start = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(0.0, limit - (time.monotonic() - start)))
    hung = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    out = {"kind": kind, "hung": hung, "exitcodes": [p.exitcode for p in procs], "stacks": _stacks(workdir),
           "seconds": time.monotonic() - start, "shm_before": len(shm_before),
           "shm_left": left_behind(shm_before), "store_keys": store.num_keys(),
           "threads_parent": threading.active_count()}
    for p in (0, 1):
        f = workdir / f"soak-{p}.json"
        out[f"process{p}"] = json.loads(f.read_text()) if f.exists() else None
    return out


def _stacks(workdir: Path) -> dict[int, str]:
    """What faulthandler wrote (a crash's or a hang's Python stacks), by process; empty when all went well."""
    found = {p: workdir / f"stacks-{p}.txt" for p in (0, 1)}
    return {p: f.read_text()[-4000:] for p, f in found.items() if f.exists() and f.stat().st_size}


__all__ = ["Interrupt", "resources", "run", "worker"]
