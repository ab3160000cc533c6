"""Trainer processes given the same rendezvous (`TrainerSession(rendezvous=...)`) instead of a trainer group, for
tests/integration/test_given_rendezvous.py: process 0 hosts the refit's store at the given address, the others
connect there, and a new init meets under a refit id of its own.

The engine is `LandingEngine`, the engine side of a cross-process refit without vLLM: in trainer process 0's own
process (it is process 0 that drives the engines), it does what a vLLM worker's `WorkerSession` does with a
loader install -- parses the init payload, checks the plan, connects to the payload's store, joins as the engine
process and opens the transport into whole tensors -- and keeps those tensors for the test to compare.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch


def weights(spec: Any, seed: int) -> dict[str, torch.Tensor]:
    """The trainer's canonical weights of generation `seed` (the test makes the same ones as its ground truth)."""
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, spec.dtype)
    return {t.name: torch.randn(t.shape, generator=g).to(dtype) for t in spec.tensors}


class LandingEngine:
    """A vLLM-free engine with one rank, replica 0 of the refit: what each init's refit lands in `tensors`."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.executor: Any = None
        self.refit_id: str | None = None  # the rendezvous of the init it is bound to
        self.version: str | None = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from reshard.adapters import rendezvous as rv
        from reshard.adapters.refit import RefitSpec, open_transport
        from reshard.executors import allocate

        refit = RefitSpec.from_dict(init_info)
        plan = refit.agreed_plan("the landing engine")
        self.close()
        rdv = rv.Rendezvous.from_dict(refit.rendezvous)
        store = rv.connect(rdv)  # where the payload says, as a worker does: not where the test gave
        process = plan.src.num_ranks  # engine replica 0's only rank, after the trainer processes
        rv.join(store, rdv, process, refit.num_processes, "engine")
        # fresh zeros each init: what the test finds after a refit landed in this init, not in an earlier one
        self.tensors = allocate(refit.destination(), ranks=[0])[0]
        self.executor = open_transport(refit, process, {}, {0: self.tensors}, store=store)
        self.refit_id, self.version = rdv.refit_id, None

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: Any) -> None:
        if update_info.get("phase", "transfer") == "transfer":
            self.executor.refit()

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.version = weight_version

    def close(self) -> None:
        if self.executor is not None:
            self.executor.close()
        self.executor = None


def refit_at_a_given_rendezvous(job: dict[str, Any]) -> None:
    """Trainer process `rank` of 2 (tp=2), given `job["rendezvous"]` and no trainer group: two inits, each followed
    by a refit of the weights of its generation (seed 1, then 2, copied into the shards in place as a training step
    would); process 0 begins each init `job["zero_late_s"]` after process 1 began it. Each process writes
    `<out>/rank<r>.json` (per init: its session's refit id); process 0 also the engine's refit id and version, and
    what landed (`<out>/landed-g<n>.safetensors`)."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    import reshard
    from reshard.adapters import rendezvous as rv
    from reshard.adapters.refit import RefitSpec
    from reshard.adapters.trainer import TrainerSession
    from reshard.executors import shard
    from reshard.polling import poll

    rank, out = dist.get_rank(), Path(job["out"])  # the gloo world is run_ranks's; the session never uses it
    spec = reshard.ModelSpec.model_validate(job["model"])
    src = reshard.MegatronLayout(model=spec, tp=2)
    refit = RefitSpec.of(spec, src, reshard.VllmLayout(model=spec), install="loader", transport="collective")
    tensors = shard(src, weights(spec, 1), ranks=[rank])[rank]
    engine = LandingEngine() if rank == 0 else None
    session = TrainerSession(refit, rank, tensors, engines=[engine] if engine else [],
                             rendezvous=rv.Rendezvous.from_dict(job["rendezvous"]), timeout=job["timeout"],
                             lease=None)
    seen: list[dict[str, Any]] = []
    try:
        for generation in (1, 2):
            if generation > 1:  # a training step: new values in the same tensors
                for name, t in shard(src, weights(spec, generation), ranks=[rank])[rank].items():
                    tensors[name].copy_(t)
            # process 1 begins each init first: the order nothing in the session prevents, where it must wait for
            # a store not up yet (init 1), and not take the last init's, still up, for this one's (init 2)
            begins = out / f"rank1-begins-g{generation}"
            if rank == 1:
                begins.touch()
            elif not poll(begins.exists, time.monotonic() + job["timeout"], first_s=0.01):
                raise TimeoutError(f"process 1 did not begin init {generation}")
            else:
                time.sleep(job["zero_late_s"])  # process 1 is in its init meanwhile
            session.init()
            session.refit(f"step-{generation}")
            seen.append({"session": session.rendezvous.refit_id})
            if engine is not None:
                seen[-1].update(engine=engine.refit_id, version=engine.version)
                save_file({n: t.contiguous() for n, t in engine.tensors.items()},
                          str(out / f"landed-g{generation}.safetensors"))
    finally:
        session.close()
        if engine is not None:
            engine.close()
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
