"""A minimal plan executor over torch.distributed point-to-point send/recv, for multi-process tests.

A stand-in until the library's torch.distributed executor (reshard.executors, issue 3) lands; tests that use
it should switch to that executor then. Every process walks the plan's transfers in plan order; the sender of
a transfer packs its blocks into one flat buffer, the receiver unpacks them. Transfers between two processes
happen in the same global order on both, so blocking send/recv cannot deadlock. Relays (fan-out) are sent
from the relaying destination rank's tensors, after the stage that filled them.

Lifecycle: 1. every process compiles (or loads) the same plan; 2. each passes the tensors of the ranks it
hosts and where every rank lives; 3. `run_plan_p2p` checks shapes and dtypes of everything it was given
before any byte moves, then moves the bytes.
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch

from ..executors.local import block, check_tensors
from ..planner import Plan
from ..planner.plan import SOURCE

RankTensors = Mapping[int, Mapping[str, torch.Tensor]]


def run_plan_p2p(plan: Plan, src: RankTensors, dst: RankTensors, *, src_process: Callable[[int], int],
                 dst_process: Callable[[int], int], group: object = None) -> int:
    """Run this process's part of `plan`. `src` / `dst`: tensors of the source / destination ranks hosted
    here; `src_process(r)` / `dst_process(r)`: the torch.distributed rank hosting layout rank r.
    Returns the number of elements this process sent to other processes."""
    import torch.distributed as dist

    me = dist.get_rank(group)
    check_tensors(plan, src, dst)
    s_flat = {(r, n): t.view(-1) for r, ts in src.items() for n, t in ts.items()}
    d_flat = {(r, n): t.view(-1) for r, ts in dst.items() for n, t in ts.items()}
    o = plan.ops
    cols = {c: o[c] for c in ("src_tensor", "src_offset", "src_stride", "dst_tensor", "dst_offset", "dst_stride",
                              "rows", "cols")}
    sent = 0
    dtype = next(iter(d_flat.values())).dtype if d_flat else next(iter(s_flat.values())).dtype
    for t in plan.transfers:
        relay = t.src_side != SOURCE
        sender = dst_process(t.src_rank) if relay else src_process(t.src_rank)
        receiver = dst_process(t.dst_rank)
        if me not in (sender, receiver):
            continue
        idx = range(t.start, t.stop)
        sizes = [int(cols["rows"][i] * cols["cols"][i]) for i in idx]
        if me == sender:
            table, flats = (plan.dst_tensors, d_flat) if relay else (plan.src_tensors, s_flat)
            parts = []
            for i in idx:
                tid = int(cols["src_tensor"][i])
                flat = flats[(table.ranks[tid], table.names[tid])]
                parts.append(block(flat, int(cols["src_offset"][i]), int(cols["rows"][i]), int(cols["cols"][i]),
                                   int(cols["src_stride"][i])).reshape(-1))
            buf = torch.cat(parts)
            if receiver != me:
                dist.send(buf, receiver, group=group)
                sent += buf.numel()
        if me == receiver:
            if sender != me:
                buf = torch.empty(sum(sizes), dtype=dtype)
                dist.recv(buf, sender, group=group)
            pos = 0
            with torch.no_grad():
                for i, n in zip(idx, sizes):
                    tid = int(cols["dst_tensor"][i])
                    flat = d_flat[(plan.dst_tensors.ranks[tid], plan.dst_tensors.names[tid])]
                    rows, c = int(cols["rows"][i]), int(cols["cols"][i])
                    block(flat, int(cols["dst_offset"][i]), rows, c, int(cols["dst_stride"][i])).copy_(
                        buf[pos:pos + n].view(rows, c) if rows > 1 else buf[pos:pos + n])
                    pos += n
    return sent
