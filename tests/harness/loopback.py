"""Run the distributed executor's schedules for every process inside one process, wires as plain buffers.

This is not an executor: it checks the schedule (bucket splitting, pack and scatter programs, rounds, staging,
commit) against `execute_local` cheaply, for many random plans, without processes or a transport.
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch

from reshard.executors.binding import Binding
from reshard.executors.copies import DST, SHADOW, SRC, WIRE, Copies, copy_view, regions
from reshard.executors.reference import apply_shifts, shift_views, torch_dtype
from reshard.executors.collective.schedule import build_schedule
from reshard.planner import Plan


def run_copies(rows: list[tuple[int, ...]], memory: Callable[[int, int], "torch.Tensor"]) -> None:
    """Run a program (from `Copies.rows_as_lists`); `memory(kind, id)` gives a flat (1-D) torch tensor."""
    for sk, si, so, sst, ssr, dk, di, do, dst_, dsr, n, r, c in rows:
        copy_view(memory(dk, di), do, dst_, dsr, n, r, c).copy_(copy_view(memory(sk, si), so, sst, ssr, n, r, c))


def run_loopback(plan: Plan, binding: Binding, src: Mapping[int, Mapping[str, torch.Tensor]],
                 dst: Mapping[int, Mapping[str, torch.Tensor]], bucket_numel: int, staged: bool = True,
                 fail_at: Callable[[list[int]], int] | None = None, direct_numel: int | None = None,
                 undo: bool = False) -> None:
    """Run every process's schedule in global round order. With `fail_at` (given the sorted round indices, it
    picks one), stop before that round as if a peer died (no commit; with `undo`, the backed-up regions are
    put back): staged or undo destinations must then be unchanged."""
    procs = binding.processes
    scheds = {p: build_schedule(plan, binding, p, bucket_numel, staged, direct_numel, undo) for p in procs}
    undo_log: list[tuple[int, Copies]] = []  # (process, restore program), as the executors keep it

    def backup(p: int, program: Copies) -> None:
        if undo and len(program):
            run_copies(regions(program, DST, SHADOW).rows_as_lists(), memory(p))
            undo_log.append((p, regions(program, SHADOW, DST)))
    s_flat = [src[r][n].view(-1) for r, n in zip(plan.src_tensors.ranks, plan.src_tensors.names)]
    d_flat = [dst[r][n].view(-1) for r, n in zip(plan.dst_tensors.ranks, plan.dst_tensors.names)]
    shadows: dict[int, dict[int, torch.Tensor]] = {
        p: {t: torch.empty_like(d_flat[t]) for t in s.shadow} for p, s in scheds.items()}
    dtype = torch_dtype(plan.dst.dtype)

    def memory(p: int, wire: torch.Tensor | None = None):
        def get(kind: int, i: int) -> torch.Tensor:
            if kind == SRC:
                return s_flat[i]
            if kind == DST:
                return d_flat[i]
            if kind == SHADOW:
                return shadows[p][i]
            assert kind == WIRE and wire is not None
            return wire
        return get

    rounds = sorted({r.index for s in scheds.values() for r in s.rounds})
    fail_at_round = fail_at(rounds) if fail_at is not None and rounds else None
    by_proc = {p: {r.index: r for r in s.rounds} for p, s in scheds.items()}
    with torch.no_grad():
        for stage in range(plan.num_stages):
            for p, s in scheds.items():
                backup(p, s.local[stage])
                run_copies(s.local[stage].rows_as_lists(), memory(p))
            for ri in rounds:
                if fail_at_round is not None and ri >= fail_at_round:
                    for p, program in reversed(undo_log):
                        run_copies(program.rows_as_lists(), memory(p))
                    return
                wires = {}
                for p in procs:
                    rnd = by_proc[p].get(ri)
                    if rnd is None or rnd.stage != stage:
                        continue
                    for m in rnd.sends:
                        direct = m.contiguous()
                        if direct is not None:  # as the executors do: send straight from that memory
                            kind, i, off = direct
                            buf = memory(p)(kind, i).narrow(0, off, m.numel).clone()
                        else:
                            buf = torch.full((m.numel,), float("nan"), dtype=dtype)
                            run_copies(m.copies.rows_as_lists(), memory(p, buf))
                        wires.setdefault((p, m.peer), []).append(buf)
                for p in procs:
                    rnd = by_proc[p].get(ri)
                    if rnd is None or rnd.stage != stage:
                        continue
                    backup(p, Copies.concat([m.copies for m in rnd.recvs]))
                    for m in rnd.recvs:
                        buf = wires[(m.peer, p)].pop(0)  # messages of one pair match in posting order
                        if buf.numel() != m.numel:
                            raise AssertionError(f"round {ri}: {m.peer}->{p} sent {buf.numel()}, expected {m.numel}")
                        direct = m.contiguous()
                        if direct is not None:  # received straight into that memory
                            kind, i, off = direct
                            memory(p)(kind, i).narrow(0, off, m.numel).copy_(buf)
                        else:
                            run_copies(m.copies.rows_as_lists(), memory(p, buf))
                wires = {k: v for k, v in wires.items() if v}
                if wires:
                    raise AssertionError(f"round {ri}: messages nobody received: {sorted(wires)}")
        for p, s in scheds.items():
            run_copies(s.commit.rows_as_lists(), memory(p))
            run_copies(s.deferred.rows_as_lists(), memory(p))
            apply_shifts(shift_views(plan, {t: d_flat[t] for t in s.part.dst_ids}))
