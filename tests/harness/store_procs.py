"""Real multi-process runs of the executors whose processes meet through a store (NIXL, shared memory), for
tests and benchmarks: a launcher, and workers that run many plans per spawned process group (spawning costs
seconds) and write what they saw as JSON. A job's "executor" names which one ("nixl" by default).

Every worker gets (process, store port, *args); the parent holds the TCPStore, so a killed worker does not
take the store with it.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

SENTINEL = -7.0


def launch(target: Callable[..., None], nprocs: int, args: tuple, timeout: float,
           on_started: Callable[[Any, list], None] | None = None) -> list[int | None]:
    """Run target(process, port, *args) in `nprocs` spawned processes; exit codes (None: killed at timeout).
    `on_started(store, processes)` runs in the parent while they work (to kill or freeze one, say)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(p, store.port, *args), daemon=True) for p in range(nprocs)]
    for p in procs:
        p.start()
    try:
        if on_started is not None:
            on_started(store, procs)
        end = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(5)
    return [p.exitcode for p in procs]


def _client(port: int) -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False)


def weights(model: Any, seed: int) -> dict[str, torch.Tensor]:
    from reshard.executors.reference import torch_dtype

    g = torch.Generator().manual_seed(seed)
    dtype = torch_dtype(model.dtype)
    return {t.name: torch.randn(t.shape, generator=g).to(dtype) for t in model.tensors}


class CallCounter:
    """Counts calls of some methods of a live NIXL agent (the calls still go through)."""

    def __init__(self, agent: Any, names: tuple[str, ...]) -> None:
        self.counts = {n: 0 for n in names}
        for n in names:
            original = getattr(agent, n)

            def counted(*a: Any, _n: str = n, _f: Callable = original, **k: Any) -> Any:
                self.counts[_n] += 1
                return _f(*a, **k)

            setattr(agent, n, counted)


def make(job: dict[str, Any], plan: Any, binding: Any, process: int, src: dict, dst: dict, store: Any,
         namespace: str) -> Any:
    """The job's executor over the store. Shared memory in place writes destinations peers map: on CPU those
    are moved into shared memory first (`shared_empty`), as an engine that accepts in-place writes allocates
    them."""
    if job.get("executor", "nixl") == "shared":
        from reshard.executors.shared import SharedExecutor, shared_empty

        options = dict(job["options"])
        if not options.get("staged", True) and all(t.device.type == "cpu" for ts in dst.values() for t in ts.values()):
            for r in dst:
                for n, t in list(dst[r].items()):
                    dst[r][n] = shared_empty(tuple(t.shape), t.dtype).copy_(t)
        return SharedExecutor(plan, binding, process, src, dst, store=store, namespace=namespace, **options)
    from reshard.executors.nixl import NixlExecutor, NixlOptions

    return NixlExecutor(plan, binding, process, src, dst, store=store, options=NixlOptions(**job["options"]),
                        namespace=namespace)


def on_device(job: dict[str, Any], tensors: dict) -> dict:
    """The job's tensors on its device ("cpu" by default; "cuda": this process's GPU, shared by all processes)."""
    device = job.get("device", "cpu")
    if device == "cpu":
        return tensors
    return {r: {n: t.to(device) for n, t in ts.items()} for r, ts in tensors.items()}


SET_UP_CALLS = ("register_memory", "deregister_memory", "prep_xfer_dlist", "make_prepped_xfer",
                "add_remote_agent", "initialize_xfer", "get_agent_metadata")


def plan_worker(process: int, port: int, workdir: str) -> None:
    """Run every job of workdir/jobs.json this process takes part in; write workdir/result-<process>.json.

    A job: {"plan": path, "binding": {...}, "options": {...}, "seed": int, "refits": int}. Each refit puts new
    weights into the same source tensors, refits, and compares this process's destination tensors with the
    local executor's (run over all ranks, from the same sentinel), byte for byte; it also checks that no
    refit registers, prepares or exchanges anything again.
    """
    from reshard.executors.binding import Binding
    from reshard.executors.reference import allocate, execute_local, shard
    from reshard.planner import Plan

    torch.set_num_threads(1)
    store = _client(port)
    jobs = json.loads((Path(workdir) / "jobs.json").read_text())
    results = []
    for k, job in enumerate(jobs):
        binding = Binding.from_dict(job["binding"])
        if process >= binding.num_processes:
            continue
        out: dict[str, Any] = {"job": k, "ok": [], "errors": []}
        try:
            plan = Plan.load(job["plan"])
            my_src, my_dst = binding.src_ranks_of(process), binding.dst_ranks_of(process)
            src = {r: {n: t.clone() for n, t in ts.items()}
                   for r, ts in shard(plan.src, weights(plan.src.model, job["seed"]), ranks=list(my_src)).items()}
            dst = allocate(plan.dst, fill=SENTINEL, ranks=list(my_dst))
            src, dst = on_device(job, src), on_device(job, dst)
            ex = make(job, plan, binding, process, src, dst, store, f"job{k}")
            conn = getattr(ex, "connection", None)  # NIXL's agent and prepared transfers
            agent = conn.agent if conn is not None else None
            counter = CallCounter(agent, SET_UP_CALLS) if agent is not None else None  # None: local only, or shm
            handles = dict(conn.handles) if conn is not None else {}
            for r in range(job["refits"]):
                w = weights(plan.src.model, job["seed"] + r)
                full = shard(plan.src, w)
                for rank in src:
                    for name, t in src[rank].items():
                        t.copy_(full[rank][name])
                stats = ex.refit()
                want = allocate(plan.dst, fill=SENTINEL)
                execute_local(plan, full, want)
                bad = [f"rank {rank} {name}" for rank in dst for name in dst[rank]
                       if not torch.equal(dst[rank][name].cpu().view(torch.uint8), want[rank][name].view(torch.uint8))]
                out["ok"].append(not bad)
                if bad:
                    out["errors"].append(f"refit {r + 1}: mismatch in {bad[:5]}")
                out["direction"] = stats.direction or None
                out["packed"] = stats.packed_transfers
                out["stats"] = {"executor": stats.executor, "ops": stats.ops, "version": stats.version,
                                "sent": {str(q): n for q, n in stats.bytes_sent.items()},
                                "received": {str(q): n for q, n in stats.bytes_received.items()}}
            out["set_up_calls_during_refits"] = {n: c for n, c in counter.counts.items() if c} if counter else {}
            out["handles_reused"] = all(conn.handles.get(i) is h for i, h in handles.items())
            ex.close()
        except Exception:  # noqa: BLE001 - reported to the parent, which fails the test
            out["errors"].append(traceback.format_exc(limit=8))
        results.append(out)
    (Path(workdir) / f"result-{process}.json").write_text(json.dumps(results))


def check_plan_results(workdir: Path, jobs: list[dict], processes: int, refits: int,
                       require_reuse: bool = False) -> None:
    """Assert that every process of every job wrote results with all refits byte-equal to the local executor's
    (and, with require_reuse, that no refit redid the transport's set-up)."""
    from reshard.executors.binding import Binding

    seen = {k: 0 for k in range(len(jobs))}
    problems = []
    for p in range(processes):
        for r in json.loads((Path(workdir) / f"result-{p}.json").read_text()):
            seen[r["job"]] += 1
            label = f"job {r['job']} process {p} ({jobs[r['job']]['label']})"
            if r["errors"]:
                problems.append(f"{label}: {r['errors']}")
            elif r["ok"] != [True] * refits:
                problems.append(f"{label}: refits ok {r['ok']}")
            elif require_reuse and (r["set_up_calls_during_refits"] or not r["handles_reused"]):
                problems.append(f"{label}: refits redid set-up: {r['set_up_calls_during_refits']}, "
                                f"handles reused {r['handles_reused']}")
    assert not problems, "\n".join(problems)
    for k, job in enumerate(jobs):
        assert seen[k] == Binding.from_dict(job["binding"]).num_processes, f"job {k} ran on {seen[k]} processes"
    _check_stats(workdir, jobs, processes, refits)


def _check_stats(workdir: Path, jobs: list[dict], processes: int, refits: int) -> None:
    """Every process's RefitStats of a job's last refit agree with its peers' (what p sent q, q received from p)
    and with the plan (every op lands on exactly one process)."""
    from reshard.planner import Plan

    stats: dict[int, dict[int, dict]] = {}
    for p in range(processes):
        for r in json.loads((Path(workdir) / f"result-{p}.json").read_text()):
            stats.setdefault(r["job"], {})[p] = r["stats"]
    for k, job in enumerate(jobs):
        by = stats[k]
        for p, s in by.items():
            assert s["executor"] == job.get("executor", "nixl") and s["version"] == refits, (k, p, s)
            for q, n in s["sent"].items():
                assert by[int(q)]["received"].get(str(p)) == n, (k, p, q, n, by[int(q)]["received"])
        assert sum(s["ops"] for s in by.values()) == Plan.load(job["plan"]).num_ops, (k, job["label"])


def failure_worker(process: int, port: int, workdir: str, scenario: str, victim: int) -> None:
    """Two refits; the second loses `victim`. Survivors write result-<process>.json with what refit 2 raised,
    how long it took, and whether their destination tensors still hold refit 1's bytes.

    scenario "killed": the victim starts refit 2 in a thread (announcing that it is ready) and SIGKILLs itself;
    the others start refit 2 once it is dead. scenario "frozen": the parent SIGSTOPs the victim after refit 1
    (key "frozen"); the others then start refit 2.
    """
    from reshard.executors.binding import Binding
    from reshard.executors.reference import allocate, shard
    from reshard.planner import Plan

    torch.set_num_threads(1)
    store = _client(port)
    job = json.loads((Path(workdir) / "failure.json").read_text())
    plan, binding = Plan.load(job["plan"]), Binding.from_dict(job["binding"])
    my_src, my_dst = binding.src_ranks_of(process), binding.dst_ranks_of(process)
    src = {r: {n: t.clone() for n, t in ts.items()}
           for r, ts in shard(plan.src, weights(plan.src.model, 1), ranks=list(my_src)).items()}
    dst = allocate(plan.dst, fill=SENTINEL, ranks=list(my_dst))
    ex = make(job, plan, binding, process, src, dst, store, scenario)
    ex.refit()
    after_first = {r: {n: t.clone() for n, t in ts.items()} for r, ts in dst.items()}
    second = shard(plan.src, weights(plan.src.model, 2), ranks=list(my_src))
    for r in src:
        for n, t in src[r].items():
            t.copy_(second[r][n])
    store.set(f"refit1/{process}", b"1")
    if process == victim:
        if scenario == "killed":
            threading.Thread(target=ex.refit, daemon=True).start()
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)  # frozen: the parent stops us here
    store.wait(["go"])
    out: dict[str, Any] = {"process": process}
    t0 = time.monotonic()
    try:
        ex.refit()
        out["error"] = None
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.monotonic() - t0
    out["unchanged"] = all(torch.equal(dst[r][n], after_first[r][n]) for r in dst for n in dst[r])
    try:
        ex.refit()
        out["reuse_error"] = None
    except Exception as e:  # noqa: BLE001
        out["reuse_error"] = f"{type(e).__name__}: {e}"
    ex.close()
    (Path(workdir) / f"result-{process}.json").write_text(json.dumps(out))


def setup_failure_worker(process: int, port: int, workdir: str) -> None:
    """A NIXL set-up that fails in one process while a peer is still setting up (job file setup_failure.json:
    plan, binding, options, "failing", "fail_at", "slow", "delay"). The failing process raises an injected error
    at `fail_at`: "check" (the first peer book it reads), "prep" (describing its first link's memory, every peer
    loaded) or "connect" (its first connection); the slow one sleeps `delay` s after publishing its metadata, so
    it is still in set-up when the other fails. Each writes setup-<process>.json: what its set-up raised, after
    how long, and the wall times at which it left set-up and released its agent."""
    from reshard.errors import ExecutionError
    from reshard.executors.binding import Binding
    from reshard.executors.exchange import Exchange
    from reshard.executors.reference import allocate, shard
    from reshard.executors.nixl import connection
    from reshard.planner import Plan

    torch.set_num_threads(1)
    store = _client(port)
    job = json.loads((Path(workdir) / "setup_failure.json").read_text())
    plan, binding = Plan.load(job["plan"]), Binding.from_dict(job["binding"])
    src = shard(plan.src, weights(plan.src.model, 1), ranks=list(binding.src_ranks_of(process)))
    dst = allocate(plan.dst, fill=SENTINEL, ranks=list(binding.dst_ranks_of(process)))
    out: dict[str, Any] = {"process": process}

    def wrap(owner: Any, name: str, before: Callable | None = None, after: Callable | None = None) -> None:
        original = getattr(owner, name)

        def wrapped(*a: Any, **k: Any) -> Any:
            if before is not None:
                before()
            result = original(*a, **k)
            if after is not None:
                after()
            return result

        setattr(owner, name, wrapped)

    if process == job["failing"]:
        fail_at = job["fail_at"]

        def refuse(*_: Any, **__: Any) -> None:
            raise ExecutionError(f"injected at {fail_at}: process {process} fails its set-up")

        if fail_at == "check":
            connection.same_refit = refuse
        elif fail_at == "prep":
            connection.side_descriptors = refuse
    make_agent = connection.make_agent

    def watched_agent(*a: Any, **k: Any) -> Any:  # the agent's teardown begins with either call
        agent = make_agent(*a, **k)
        for name in ("remove_remote_agent", "deregister_memory"):
            wrap(agent, name, before=lambda: out.setdefault("released", time.time()))
        if process == job["failing"] and job["fail_at"] == "connect":
            agent.make_connection = refuse
        return agent

    connection.make_agent = watched_agent
    if process == job["slow"]:
        wrap(Exchange, "publish", after=lambda: time.sleep(job["delay"]))
    wrap(Exchange, "leave_setup", before=lambda: out.setdefault("left", time.time()))
    store.set(f"start/{process}", b"1")
    store.wait([f"start/{p}" for p in range(binding.num_processes)])
    t0 = time.monotonic()
    try:
        make(job, plan, binding, process, src, dst, store, "setup-failure").close()
        out["error"] = None
    except Exception as e:  # noqa: BLE001 - the test checks the type and the words
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.monotonic() - t0
    (Path(workdir) / f"setup-{process}.json").write_text(json.dumps(out))
