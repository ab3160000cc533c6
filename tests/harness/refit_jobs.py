"""Jobs for `reshard.testing.world`: run refits across real processes and check them against `execute_local`.

A case is JSON: {"plan": path of a saved plan, "binding": {"src": [...], "dst": [...]}, "group": world ranks
of the refit group or null for the whole world, "seed": int, "options": executor options}. Every process
builds the same canonical weights from the seed, shards them for the source ranks it plays, fills its
destination tensors with a sentinel, runs the executor, and compares its destination tensors byte for byte
with `execute_local` of the same plan on the same inputs. In an NCCL world the tensors live on the process's GPU.
"""
from __future__ import annotations

import os
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from reshard.errors import ExecutionError
from reshard.executors import allocate, execute_local, shard
from reshard.executors.binding import Binding
from reshard.executors.collective.comm import StoreComm
from reshard.executors.collective.executor import CollectiveExecutor
from reshard.executors.base import RefitStats
from reshard.planner import Plan

SENTINEL = -7.0


def _weights(plan: Plan, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=g) for t in plan.src.model.tensors}


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    a = a.cpu()
    return a.shape == b.shape and torch.equal(a.flatten().view(torch.uint8), b.flatten().view(torch.uint8))


def _groups(cases: list[dict], size: int) -> dict[tuple[int, ...], Any]:
    """Every subgroup the cases use, created in the same order on every process (new_group is collective)."""
    groups: dict[tuple[int, ...], Any] = {}
    for c in cases:
        members = tuple(c["group"]) if c.get("group") is not None else tuple(range(size))
        if members not in groups:
            groups[members] = dist.group.WORLD if members == tuple(range(size)) else dist.new_group(list(members))
    return groups


def _group(case: dict[str, Any], groups: dict, members: tuple[int, ...], me: int, timeout: float) -> Any:
    """The case's refit group: a torch group of the world, or (case "store") a StoreComm made over a FileStore
    of the case's own, as processes outside one world (a trainer and a vLLM server) make it."""
    if not case.get("store"):
        return groups[members]
    store = dist.FileStore(case["plan"] + ".store", len(members))
    backend = str(dist.get_backend()).lower()
    return StoreComm(store, me, len(members), "nccl" if "nccl" in backend else "gloo", timeout)


def _stats(s: RefitStats) -> dict[str, Any]:
    return {"bytes_sent": {str(k): v for k, v in s.bytes_sent.items()},
            "bytes_received": {str(k): v for k, v in s.bytes_received.items()},
            "local_bytes": s.local_bytes, "rounds": s.rounds, "transfers": s.transfers, "staged": s.staged,
            "undo": s.undo, "lanes": s.lanes,
            "staging_bytes": s.staging_bytes, "bucket_bytes": s.bucket_bytes}


def _device() -> torch.device:
    if "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _tensors(plan: Plan, binding: Binding, me: int, seed: int):
    mine_src = list(binding.src_ranks_of(me))
    mine_dst = list(binding.dst_ranks_of(me))
    weights = _weights(plan, seed)
    src = shard(plan.src, weights, ranks=mine_src) if mine_src else {}
    dst = allocate(plan.dst, fill=SENTINEL, ranks=mine_dst) if mine_dst else {}
    device = _device()
    if device.type != "cpu":
        src, dst = ({r: {n: t.to(device) for n, t in ts.items()} for r, ts in side.items()} for side in (src, dst))
    return weights, src, dst


def run_cases(rank: int, size: int, args: dict[str, Any]) -> list[dict[str, Any] | None]:
    """Run every case (as many runs as `repeat`, reusing one executor); one result per case."""
    cases = args["cases"]
    groups = _groups(cases, size)
    plans: dict[str, Plan] = {}
    results: list[dict[str, Any] | None] = []
    for c in cases:
        members = tuple(c["group"]) if c.get("group") is not None else tuple(range(size))
        if rank not in members:
            results.append(None)
            continue
        me = members.index(rank)
        start = time.monotonic()
        try:
            plan = plans.get(c["plan"]) or plans.setdefault(c["plan"], Plan.load(c["plan"]))
            binding = Binding.from_dict(c["binding"])
            weights, src, dst = _tensors(plan, binding, me, c["seed"])
            want = allocate(plan.dst, fill=SENTINEL)
            execute_local(plan, shard(plan.src, weights), want)
            options = c.get("options", {})
            group = _group(c, groups, members, me, options.get("timeout", 60.0))
            ex = CollectiveExecutor(plan, binding, me, src, dst, group=group, **options)
            if c.get("refuse") is not None:  # one process passes a tensor of the wrong shape
                results.append(_refused(ex, src, dst, me == c["refuse"]))
                continue
            for _ in range(c.get("repeat", 1)):
                stats = ex.refit()
            wrong = [f"destination rank {r} {n!r}" for r, ts in dst.items() for n, t in ts.items()
                     if not _same_bytes(t, want[r][n])]
            results.append({"ok": not wrong, "error": "; ".join(wrong[:5]), "stats": _stats(stats),
                            "seconds": round(time.monotonic() - start, 3)})
        except Exception as e:  # reported to the test, which fails with it
            results.append({"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})
    return results


def _refused(ex: CollectiveExecutor, src: dict, dst: dict, culprit: bool) -> dict[str, Any]:
    """Every process must raise ExecutionError before anything moves; the culprit's message names the tensor."""
    side = dst if dst else src
    rank = next(iter(side))
    name = next(iter(side[rank]))
    if culprit:
        side = {**side, rank: {**side[rank], name: side[rank][name][..., :-1].contiguous()}}
        src, dst = (src, side) if dst else (side, dst)
    try:
        ex.refit(src=src, dst=dst)
        return {"ok": False, "error": "the refit ran although a process refused its tensors"}
    except ExecutionError as e:
        msg = str(e)
    expected = name if culprit else "refused its tensors"
    untouched = all(bool((t == SENTINEL).all()) for ts in dst.values() for t in ts.values())
    ok = expected in msg and "nothing was moved" in msg
    return {"ok": ok and untouched, "error": f"message {msg!r}, destinations untouched: {untouched}"}


def fail_mid_refit(rank: int, size: int, args: dict[str, Any]) -> dict[str, Any]:
    """One refit in which group rank `victim` dies (mode "kill") or stops (mode "hang") when it reaches round
    `at_round`. Survivors report whether they raised ExecutionError, how long they took, and whether their
    destination tensors are unchanged."""
    plan = Plan.load(args["plan"])
    binding = Binding.from_dict(args["binding"])
    _, src, dst = _tensors(plan, binding, rank, args["seed"])
    victim, mode, at_round = args["victim"], args["mode"], args["at_round"]

    def on_round(index: int) -> None:
        if rank == victim and index >= at_round:
            if mode == "kill":
                os._exit(17)
            time.sleep(args["hang_seconds"])
            os._exit(18)

    group = _group({"plan": args["plan"], "store": args.get("store")}, {tuple(range(size)): None}, tuple(range(size)), rank,
                   args["options"]["timeout"])
    ex = CollectiveExecutor(plan, binding, rank, src, dst, group=group, **args["options"], on_round=on_round)
    dist.barrier()  # start the clocks together
    start = time.monotonic()
    try:
        ex.refit()
        raised, message = None, ""
    except ExecutionError as e:
        raised, message = "ExecutionError", str(e)
    except Exception as e:  # noqa: BLE001 - the test checks that only ExecutionError escapes
        raised, message = type(e).__name__, str(e)
    elapsed = time.monotonic() - start
    unchanged = all(bool((t == SENTINEL).all()) for ts in dst.values() for t in ts.values())
    return {"raised": raised, "message": message, "seconds": elapsed, "unchanged": unchanged,
            "has_dst": bool(dst), "lanes": len(ex.lanes)}
