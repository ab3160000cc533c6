"""Refit over NIXL: two trainer processes (Megatron TP 2) write into one engine process (vLLM TP 1) through NIXL
one-sided transfers, three refits, on CPU.

What each process does with reshard: compile the plan (every process compiles the same one, from the same
declarations), build its `NixlExecutor` once (memory registration, the metadata exchange through a
torch.distributed store, the descriptor lists), then call `refit()` after each weight update. The engine process
checks every refit against the weights laid out directly by the destination layout (`reshard.executors.shard`,
which reads the layout without the compiler) and this script exits 1 when a byte differs.

    python examples/executors/nixl_refit.py      # the core virtualenv (nixl installed); a few seconds on CPU
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import sys

import torch
import torch.distributed as dist

import reshard
from reshard.executors import Binding, allocate, shard
from reshard.executors.nixl import NixlExecutor, NixlOptions

HF_CONFIG = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=128, hidden_size=64,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=96, torch_dtype="bfloat16", tie_word_embeddings=False)
REFITS = 3
BINDING = Binding.disjoint(num_src=2, num_dst=1)  # processes 0, 1: trainer ranks; process 2: the engine


def layouts() -> tuple[reshard.MegatronLayout, reshard.VllmLayout]:
    spec = reshard.ModelSpec.from_hf_config(HF_CONFIG)
    return reshard.MegatronLayout(model=spec, tp=2), reshard.VllmLayout(model=spec, tp=1)


def weights(step: int) -> dict[str, torch.Tensor]:
    """Canonical weights of one training step (what the trainer would hold; the same on every process)."""
    spec = layouts()[0].model
    g = torch.Generator().manual_seed(step)
    return {t.name: torch.randn(t.shape, generator=g).to(torch.bfloat16) for t in spec.tensors}


# --8<-- [start:nixl_executor]
def run(process: int, port: int) -> int:
    """One process's refits; returns how many destination tensors differed from the reference (engine only)."""
    src_layout, dst_layout = layouts()
    plan = reshard.compile(src_layout, dst_layout)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    mine_src, mine_dst = BINDING.src_ranks_of(process), BINDING.dst_ranks_of(process)
    src = shard(src_layout, weights(0), ranks=list(mine_src))      # the trainer's tensors, updated in place
    dst = allocate(dst_layout, ranks=list(mine_dst)) if mine_dst else {}  # the engine's tensors, zeros
    wrong = 0
    with NixlExecutor(plan, BINDING, process, src, dst, store=store, options=NixlOptions(checksum=True),
                      namespace="example") as executor:
        for step in range(1, REFITS + 1):
            for rank, ts in shard(src_layout, weights(step), ranks=list(mine_src)).items():
                for name, t in ts.items():
                    src[rank][name].copy_(t)                        # a training step, in place
            stats = executor.refit(version=step)
            if mine_dst:
                want = shard(dst_layout, weights(step), ranks=list(mine_dst))
                bad = [f"rank {r} {n}" for r in want for n in want[r] if not torch.equal(dst[r][n], want[r][n])]
                wrong += len(bad)
                print(f"refit {step}: {sum(stats.bytes_received.values())} bytes received, "
                      f"{'equal to the reference' if not bad else f'{len(bad)} tensors differ: {bad[:3]}'}")
    return wrong
# --8<-- [end:nixl_executor]


def _process(process: int, port: int, results: "mp.Queue[tuple[int, int]]") -> None:
    torch.set_num_threads(1)
    results.put((process, run(process, port)))


def main() -> int:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the parent holds the store
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_process, args=(p, store.port, results)) for p in range(BINDING.num_processes)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    failed = [i for i, p in enumerate(procs) if p.exitcode != 0]
    for p in procs:
        if p.is_alive():
            p.kill()
    wrong = sum(results.get(timeout=5)[1] for _ in range(len(procs) - len(failed)))
    if failed or wrong:
        print(f"FAILED: processes {failed} exited non-zero; {wrong} destination tensors differ", file=sys.stderr)
        return 1
    print(f"{REFITS} refits over NIXL: every destination tensor equal to the reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
