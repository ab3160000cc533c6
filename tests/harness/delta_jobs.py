"""Jobs for `reshard.testing.world`: delta refits (executors.delta) across real processes, each step checked against
a dense refit of the same source by the reference executor; and the delta apply kernel against torch's scatter.

A case is JSON: {"plan": path, "binding": {...}, "seed": int, "steps": int, "fraction": changed per step,
"options": CollectiveExecutor options, "keyframe_every": K, "stale": [step, process] (that process's receiver
forgets its version before the step: the step must be a keyframe), "corrupt": [step, process] (that sender flips a
value byte after its digest: every process must fail and leave its destinations as they were), "corrupt_base":
[step, process] (that sender's payloads claim another base version: their receivers refuse them, naming both),
"fail_read": [step, process] (that receiver's next read raises as a GPU out of memory would),
"device": "cuda" (every tensor on the process's GPU; default "cpu")}.
`voted_delta_worker` runs the same cases over the executors that vote through a store (`"executor"`: "shared" or
"nixl"; `"options"` are SharedExecutor's or NixlOptions'; a failed executor is rebuilt under a new namespace, as
they require). Every process
builds the canonical weights from the seed and changes them the same way each step, so each knows the whole
expected result.
"""
from __future__ import annotations

import traceback
from typing import Any

import torch

from reshard.errors import ExecutionError
from reshard.executors import allocate, execute_local, shard
from reshard.executors.binding import Binding
from reshard.executors.collective.executor import CollectiveExecutor
from reshard.executors.delta import DeltaPolicy, _sections
from reshard.planner import Plan

SENTINEL = -7.0


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _step(weights: dict[str, torch.Tensor], seed: int, step: int, fraction: float) -> None:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    for name in sorted(weights):
        w = weights[name]
        mask = torch.rand(w.shape, generator=g) < fraction
        w[mask] += 1.0


def run_delta_cases(rank: int, size: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    """Every case on the whole world; per case, per step: whether this process's destinations are right, the
    refit's kind and bytes, or the error."""
    return [_case(rank, c, _collective) for c in args["cases"]]


def voted_delta_worker(process: int, port: int, workdir: str) -> None:
    """harness.store_procs.launch's target: the cases of workdir/cases.json over SharedExecutor or NixlExecutor
    (delta=...); writes workdir/result-<process>.json (as run_delta_cases returns)."""
    import json
    from pathlib import Path

    from harness.store_procs import _client

    torch.set_num_threads(1)
    store = _client(port)
    cases = json.loads((Path(workdir) / "cases.json").read_text())
    results = [_case(process, c, _voted(store, f"case{k}")) for k, c in enumerate(cases)]
    (Path(workdir) / f"result-{process}.json").write_text(json.dumps(results))


def _collective(plan, binding, rank, src, dst, c):
    return CollectiveExecutor(plan, binding, rank, src, dst, delta=DeltaPolicy(c["keyframe_every"]),
                              **c.get("options", {}))


def _voted(store, namespace: str):
    built = [0]

    def make(plan, binding, rank, src, dst, c):
        built[0] += 1
        policy, options, name = DeltaPolicy(c["keyframe_every"]), c.get("options", {}), f"{namespace}-{built[0]}"
        if c.get("executor", "shared") == "nixl":
            from reshard.executors.nixl import NixlExecutor, NixlOptions

            return NixlExecutor(plan, binding, rank, src, dst, store=store, namespace=name,
                                options=NixlOptions(**options), delta=policy)
        from reshard.executors.shared import SharedExecutor

        return SharedExecutor(plan, binding, rank, src, dst, store=store, namespace=name, delta=policy, **options)

    return make


def _case(rank: int, c: dict[str, Any], make) -> dict[str, Any]:
    try:
        plan, binding = Plan.load(c["plan"]), Binding.from_dict(c["binding"])
        g = torch.Generator().manual_seed(c["seed"])
        weights = {t.name: torch.randn(t.shape, generator=g) for t in plan.src.model.tensors}
        device = torch.device(c.get("device", "cpu"))  # "cuda": every tensor on this process's GPU
        full = {r: {n: t.to(device) for n, t in ts.items()} for r, ts in shard(plan.src, weights).items()}
        src = {r: {n: t.clone() for n, t in full[r].items()} for r in binding.src_ranks_of(rank)}
        dst = allocate(plan.dst, fill=SENTINEL, ranks=list(binding.dst_ranks_of(rank)), device=device) if (
            binding.dst_ranks_of(rank)) else {}
        if c.get("executor") == "shared" and not c.get("options", {}).get("staged", True):
            # in place over shared memory: peers map the tensors
            from reshard.executors.shared import shared_empty

            dst = {r: {n: shared_empty(tuple(t.shape), t.dtype).copy_(t) for n, t in ts.items()}
                   for r, ts in dst.items()}
        ex = make(plan, binding, rank, src, dst, c)
        steps = []
        for step in range(c["steps"]):
            if step:
                _step(weights, c["seed"], step, c["fraction"])
                for r, ts in shard(plan.src, weights).items():
                    for n, t in ts.items():
                        full[r][n].copy_(t)
                        if r in src:
                            src[r][n].copy_(t)
            if c.get("stale") == [step, rank]:
                ex._delta.receiver.held = None
            before = {r: {n: t.clone() for n, t in ts.items()} for r, ts in dst.items()}
            corrupt = c.get("corrupt") == [step, rank]
            if corrupt:
                _corrupt_next(ex)
            if c.get("corrupt_base") == [step, rank]:
                _corrupt_next(ex, base=True)
            if c.get("fail_read") == [step, rank]:
                _fail_next_read(ex)
            try:
                stats = ex.refit()
            except ExecutionError as e:
                kept = all(torch.equal(_bits(t), _bits(before[r][n])) for r, ts in dst.items() for n, t in ts.items())
                steps.append({"failed": str(e)[:600], "kept": kept})
                if getattr(ex, "_broken", None) is not None:  # a voted executor: rebuilt, its first refit a keyframe
                    ex.close()
                    ex = make(plan, binding, rank, src, dst, c)
                continue
            want = allocate(plan.dst, fill=SENTINEL, device=device)
            execute_local(plan, full, want)
            wrong = [f"{r} {n}" for r, ts in dst.items() for n, t in ts.items() if not torch.equal(_bits(t),
                                                                                                 _bits(want[r][n]))]
            report = ex.last_delta
            steps.append({"ok": not wrong, "wrong": wrong[:3], "keyframe": None if report is None else report.keyframe,
                          "sent": sum(stats.bytes_sent.values()), "local": stats.local_bytes,
                          "wire": None if report is None else report.wire_bytes,
                          "dense": None if report is None else report.dense_bytes,
                          "ops": None if report is None else report.ops})
        ex.close()
        return {"steps": steps}
    except Exception as e:  # reported to the test, which fails with it
        return {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}


def _fail_next_read(ex) -> None:
    """The receiver's next read of a payload raises as a GPU out of memory would (a RuntimeError, not a refusal)."""
    receiver = ex._delta.receiver
    read = receiver.read

    def failing(*args, **kwargs):
        receiver.read = read
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 5.35 GiB (injected by the test)")
    receiver.read = failing


def _corrupt_next(ex, base: bool = False) -> None:
    """The sender's next payloads get their first value byte flipped after encoding (the digest already taken), or
    with `base`, claim a base version one below the real one."""
    sender = ex._delta.sender
    encode = sender.encode

    def corrupted(*a, **k):
        payload, delta = encode(*a, **k)
        if base:
            payload[16:24] = torch.tensor([int(payload[16:24].view(torch.int64)) - 1]).view(torch.uint8)
        elif len(delta):  # the first value byte (the sections' padding is no data)
            at = _sections(ex.plan, delta.op, delta.encoding, delta.count, len(k.get("digest", b"")))
            payload[at["values"] if at["dense"] > at["values"] else at["dense"]] ^= 0x55
        sender.encode = encode
        return payload, delta

    sender.encode = corrupted


def check_apply_kernel(device: str = "cpu", cases: int = 4) -> list[str]:
    """kernels.delta_apply.scatter against torch's index_put_ on random entries (run under TRITON_INTERPRET on
    CPU); the problems found."""
    import numpy as np

    from reshard.kernels.delta_apply import scatter

    problems = []
    g = np.random.default_rng(0)
    for case in range(cases):
        tensors = [torch.randint(-1000, 1000, (int(g.integers(64, 5000)),), dtype=torch.int16, device=device)
                   for _ in range(3)]
        want = [t.clone() for t in tensors]
        taken = [np.zeros(t.numel(), dtype=bool) for t in tensors]
        targets, origin, count, cols, stride, idx, vals = [], [], [], [], [], [], []
        for _ in range(int(g.integers(1, 8))):
            k = int(g.integers(0, 3))
            n = tensors[k].numel()
            c = int(g.integers(1, 40))
            s = c + int(g.integers(0, 8))
            rows = max(1, (n - c) // s // 2)
            o = int(g.integers(0, max(1, n - (rows - 1) * s - c)))
            box = rows * c
            i = np.sort(g.choice(box, size=int(g.integers(1, min(box, 2500) + 1)), replace=False))
            i = i[~taken[k][o + (i // c) * s + i % c]]  # entries of a delta never overlap (planner.delta)
            if not len(i):
                continue
            taken[k][o + (i // c) * s + i % c] = True
            v = torch.randint(-30000, 30000, (len(i),), dtype=torch.int16, device=device)
            pos = torch.from_numpy(o + (i // c) * s + i % c).to(device)
            want[k][pos] = v
            targets.append(tensors[k])
            origin.append(o)
            count.append(len(i))
            cols.append(c)
            stride.append(s)
            idx.append(torch.from_numpy(i).to(device))
            vals.append(v)
        scatter(targets, np.asarray(origin), np.asarray(count), np.asarray(cols), np.asarray(stride),
                torch.cat(idx), torch.cat(vals), block=128)
        if device != "cpu":
            torch.cuda.synchronize()
        for k, (t, w) in enumerate(zip(tensors, want)):
            if not torch.equal(t, w):
                problems.append(f"case {case} tensor {k}: {int((t != w).sum())} elements differ")
    return problems
