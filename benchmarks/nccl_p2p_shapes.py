"""What NCCL point-to-point messages cost beyond their bytes, and what lanes (extra communicators) buy back.

Two processes, one GPU each, move 8.19 GB each way (both directions at once, as in refit_nccl.py's E3) cut
into messages of different sizes, posted in groups (`batch_isend_irecv`, one per round) on one communicator
or alternating between communicators. The first row, eight 1 GiB messages in one group, is the ceiling every
other row is printed against. This is the measurement behind executors.collective.lanes.

    torchrun --nproc_per_node 2 benchmarks/nccl_p2p_shapes.py      # export NCCL_NVLS_ENABLE=0 first
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

GiB, MiB = 1 << 30, 1 << 20
ELEMENTS = 8192 * 499876  # 8.19 GB of bf16 each way


def main() -> None:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=device)
    peer = 1 - rank
    lanes = [dist.group.WORLD] + [dist.new_group([0, 1]) for _ in range(2)]
    send = torch.ones(ELEMENTS, dtype=torch.bfloat16, device=device)
    recv = torch.empty_like(send)

    def messages(nbytes: int) -> list[tuple[int, int]]:
        n = nbytes // 2
        return [(i, min(n, ELEMENTS - i)) for i in range(0, ELEMENTS, n)]

    def rounds(msgs: list, per_round: int) -> list[list]:
        return [msgs[i:i + per_round] for i in range(0, len(msgs), per_round)]

    def post(batches: list[tuple[int, list]]) -> None:
        works = []
        for lane, msgs in batches:
            g = lanes[lane]
            ops = []
            for i, n in msgs:
                ops += [dist.P2POp(dist.isend, send[i:i + n], peer, g), dist.P2POp(dist.irecv, recv[i:i + n], peer, g)]
            works += dist.batch_isend_irecv(ops)
        for w in works:
            w.wait()

    big, mid, small = messages(GiB), messages(100 * MiB), messages(25 * MiB)
    shapes = {
        "8 x 1 GiB, one group (ceiling)": [(0, big)],
        "8 rounds of 1 x 1 GiB": [(0, r) for r in rounds(big, 1)],
        "79 x 100 MiB, one group": [(0, mid)],
        "8 rounds of 10 x 100 MiB": [(0, r) for r in rounds(mid, 10)],
        "79 rounds of 1 x 100 MiB": [(0, r) for r in rounds(mid, 1)],
        "8 rounds of 40 x 25 MiB": [(0, r) for r in rounds(small, 40)],
        "8 rounds of 10 x 100 MiB, 2 lanes": [(k % 2, r) for k, r in enumerate(rounds(mid, 10))],
        "8 rounds of 10 x 100 MiB, 3 lanes": [(k % 3, r) for k, r in enumerate(rounds(mid, 10))],
        "8 rounds of 40 x 25 MiB, 3 lanes": [(k % 3, r) for k, r in enumerate(rounds(small, 40))],
    }
    results = {}
    for name, batches in shapes.items():
        times = []
        for _ in range(6):
            dist.barrier()
            torch.cuda.synchronize()
            t = time.perf_counter()
            post(batches)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        results[name] = statistics.median(times[1:])
    if rank == 0:
        ceiling = next(iter(results.values()))
        print(f"NCCL p2p, 8.19 GB each way at once, {torch.cuda.get_device_name(0)} x2, NCCL "
              f"{'.'.join(map(str, torch.cuda.nccl.version()))}")
        print("shape | messages each way | ms | % of ceiling | extra us per message beyond the ceiling's 8")
        for name, t in results.items():
            n = sum(len(m) for _, m in shapes[name])
            extra = f"{(t - ceiling) / (n - len(big)) * 1e6:.0f}" if n > len(big) else "-"
            print(f"{name} | {n} | {t * 1e3:.2f} | {100 * ceiling / t:.0f}% | {extra}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
