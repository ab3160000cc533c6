"""Every wait of a refit, enumerated: a peer frozen (SIGSTOP) at one phase of a refit, for each transport, on CPU, in
forked processes that meet through a TCPStore the parent holds (the plan, binding and executors of
harness.faults). The phases are data, `PHASES` (one row per (kind, phase): where the victim freezes and the
words the survivors' error must have), so a new wait is one more row.

One case, three processes (the victim: process 2, a destination process every other one talks to, unless the
phase is a sender's). Each process
meets the others (a start barrier), builds its executor and refits once unless the phase is set-up; then, at the
phase, the victim freezes and every survivor records what it was doing raised, after how long. The parent kills
the victim once the survivors are done. The cases of a run go in parallel (a frozen wait costs no CPU).
"""
from __future__ import annotations

import json
import os
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .clock import OwnClock
from .faults import PROCESSES, _weights, binding, context, fault_plan, make_executor

START_LIMIT = 120.0  # seconds the processes of a case may take to start and meet (forked: about one)


@dataclass(frozen=True)
class Phase:
    """A wait of a refit: `when` the survivors' clock runs ("setup": building the executor; "refit"; "close";
    "join": the rendezvous; "first-refit": the first refit, the victim frozen as it leaves set-up), `freeze` what
    makes the victim stop there (given its executor), `words` a regular expression the survivors' ExecutionError
    must match (it names the phase), `victim` the process that freezes (one that takes part in the phase: a sender
    for a sender's step)."""

    kind: str
    name: str
    when: str
    freeze: Callable[[Any], None] | None
    words: str
    victim: int = 2


def _stop() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)  # frozen until the parent kills it
    time.sleep(3600)


def _at_round(ex: Any) -> None:
    ex.on_round = lambda index: _stop() if index >= 1 else None


def _replace(attr: str) -> Callable[[Any], None]:
    return lambda ex: setattr(ex, attr, lambda *a, **k: _stop())


def _after_post(ex: Any) -> None:
    post = ex.connection.post
    ex.connection.post = lambda link, message: (post(link, message), _stop())


def _before_ready(ex: Any) -> None:
    signal_ = ex.exchange.signal
    ex.exchange.signal = lambda key: _stop() if "/ready/" in key else signal_(key)


def _at_notify(ex: Any) -> None:
    ex.connection.notify = lambda *a, **k: _stop()


def _after_done(ex: Any) -> None:
    signal_ = ex.exchange.signal
    ex.exchange.signal = lambda key: (signal_(key), _stop()) if "/done/" in key else signal_(key)


def _at_vote(ex: Any) -> None:
    ex.exchange.vote = lambda version: _stop()


PHASES: tuple[Phase, ...] = (
    Phase("any", "rendezvous", "join", None, r"did not join within"),
    Phase("gloo", "setup", "setup", None, r"set-up: .*gloo group"),
    Phase("gloo", "agreement", "refit", _replace("_preflight"), r"preflight all-reduce did not complete"),
    Phase("gloo", "transfer", "refit", _at_round, r"round \d+"),
    Phase("gloo", "checksum", "refit", _replace("_compare_checksums"), r"checksum exchange with peers did not"),
    Phase("gloo", "commit", "refit", _replace("_agree"), r"verify all-reduce did not complete"),
    Phase("gloo", "close", "close", None, ""),
    Phase("nixl", "setup", "setup", None, r"set-up: process 2 did not publish"),
    Phase("nixl", "peers-set-up", "first-refit", None, r"process\(es\) \[2\] did not finish setting up"),
    Phase("nixl", "transfer-ready", "refit", _at_notify, r"waiting for: link .*no ready notification", victim=0),
    Phase("nixl", "transfer", "refit", _after_post, r"waiting for: link .*process 2 has not finished"),
    Phase("nixl", "commit", "refit", _at_vote, r"only 2 of 3 processes finished"),
    Phase("nixl", "close", "close", None, ""),
    Phase("shared", "setup", "setup", None, r"set-up: process 2 did not publish"),
    Phase("shared", "transfer-ready", "refit", _before_ready, r"(waiting|waited) for process 2 to be ready"),
    Phase("shared", "transfer", "refit", _after_done, r"(waiting|waited) for processes \[0", victim=0),
    Phase("shared", "commit", "refit", _at_vote, r"only 2 of 3 processes finished"),
    Phase("shared", "close", "close", None, ""),
)
BY_ID = {f"{p.kind}-{p.name}": p for p in PHASES}


def _meet(store: Any, key: str) -> None:
    """Every process of the case reached `key` (bounded: a process that never starts fails the case)."""
    store.add(key, 1)
    end = time.monotonic() + START_LIMIT
    while int(store.add(key, 0)) < PROCESSES:
        if time.monotonic() > end:
            raise TimeoutError(f"the case's processes did not all reach {key!r}")
        time.sleep(0.01)


def worker(process: int, port: int, workdir: str, case_id: str) -> None:
    """One process of a case; a survivor writes workdir/<case>-<process>.json."""
    import torch
    import torch.distributed as dist

    from reshard.adapters import rendezvous as rv
    from reshard.executors.reference import allocate, shard
    from reshard.planner import Plan

    torch.set_num_threads(1)
    case = json.loads((Path(workdir) / "case.json").read_text())
    phase, timeout = BY_ID[case_id], case["timeout"]
    root = dist.TCPStore("127.0.0.1", port, is_master=False)
    store = dist.PrefixStore(f"{case_id}/", root)
    victim = process == phase.victim
    out: dict[str, Any] = {"process": process, "case": case_id}
    start: OwnClock | None = None  # started when the measured wait began
    try:
        plan, b = Plan.load(case["plan"]), binding()
        src = shard(plan.src, _weights(plan.src.model, 1), ranks=list(b.src_ranks_of(process)))
        dst = allocate(plan.dst, fill=-7.0, ranks=list(b.dst_ranks_of(process)))
        if phase.kind == "nixl":  # NIXL's import and agent take seconds on a loaded machine and are no wait
            from reshard.executors.nixl.agent import make_agent_ahead

            make_agent_ahead(f"case:{process}", 1000)  # the executor's agent (namespace "case")
        _meet(store, "start")
        if phase.when == "join":
            rdv = rv.Rendezvous.from_dict(case["rendezvous"])
            if victim:
                _stop()
            mine = rv.connect(rdv)
            start = OwnClock()
            rv.join(mine, rdv, process, PROCESSES, "trainer")
        elif phase.when == "setup":
            if victim:
                _stop()
            start = OwnClock()
            make_executor(phase.kind, plan, process, src, dst, store, "case", timeout, checksum=True,
                          setup_timeout=timeout)
        elif phase.when == "first-refit":  # the victim freezes as it would leave set-up; the others refit
            if victim:
                from reshard.executors.exchange import Exchange

                Exchange.leave_setup = lambda self, process: _stop()
            ex = make_executor(phase.kind, plan, process, src, dst, store, "case", timeout, checksum=True)
            start = OwnClock()
            ex.refit()
            ex.close()
        else:
            # the set-up of the other phases' cases may wait longer (a loaded machine): the refit's waits are
            # bounded by the executor's own timeout, which is `timeout`
            ex = make_executor(phase.kind, plan, process, src, dst, store, "case", timeout, checksum=True)
            ex.refit()
            if victim and phase.freeze is not None:
                phase.freeze(ex)
            _meet(store, "armed")
            if victim and phase.when == "close":
                _stop()
            start = OwnClock()
            if phase.when == "refit":
                ex.refit()
            ex.close()
            if phase.kind == "gloo":  # the group too (StoreComm.close: its lanes shut down, bounded)
                ex.comm.close()
        out["error"] = None
    except Exception as e:  # noqa: BLE001 - the test checks the type and the words
        out["error"] = f"{type(e).__name__}: {e}"
        if start is None:  # failed before the phase: the case itself is broken
            out["crash"] = traceback.format_exc(limit=6)
    out["seconds"] = start.seconds() if start is not None else None  # own time: the machine's queueing excluded
    out["wall_seconds"] = start.wall() if start is not None else None
    (Path(workdir) / f"{case_id}-{process}.json").write_text(json.dumps(out))
    os._exit(0)  # not torch's destructors: a gloo group's waits on the frozen peer at exit are not the refit's


def run_cases(case_ids: list[str], workdir: Path, timeout: float, limit: float = 180.0) -> dict[str, list[dict]]:
    """Run the cases at once; {case id: the survivors' results}."""
    import torch.distributed as dist

    from reshard.adapters import rendezvous as rv

    workdir.mkdir(parents=True, exist_ok=True)
    plan = fault_plan(workdir / "plan.npz")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    rdv, rdv_store = rv.host_store(rv.Rendezvous.new(timeout=timeout))
    (workdir / "case.json").write_text(json.dumps({"timeout": timeout, "plan": str(plan),
                                                   "rendezvous": rdv.to_dict()}))
    ctx = context()
    procs = {(c, p): ctx.Process(target=worker, args=(p, store.port, str(workdir), c), daemon=True)
             for c in case_ids for p in range(PROCESSES)}
    for proc in procs.values():
        proc.start()
    end = time.monotonic() + limit
    try:
        for (c, p), proc in procs.items():
            if p != BY_ID[c].victim:
                proc.join(max(0.0, end - time.monotonic()))
    finally:
        for proc in procs.values():
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(5)
        del rdv_store
    results: dict[str, list[dict]] = {c: [] for c in case_ids}
    for c in case_ids:
        for p in range(PROCESSES):
            f = workdir / f"{c}-{p}.json"
            if p != BY_ID[c].victim:
                results[c].append(json.loads(f.read_text()) if f.exists() else {"process": p, "crash": "no result"})
    return results


__all__ = ["BY_ID", "PHASES", "Phase", "run_cases", "worker"]
