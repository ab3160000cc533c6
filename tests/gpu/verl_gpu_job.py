"""One process of the verl backend's GPU test (tests/gpu/test_verl_gpu.py): verl's lifecycle replayed by hand on a
trainer rank and a rollout rank, two processes on one GPU, through the shared transport (CUDA IPC) with "sum64"
checksums.

verl itself does not install on the GPU machine (its checkpoint_engine package imports Ray, FastAPI and the rest of
verl); where it is missing, a stand-in of the two names the backend subclasses and registers with
(`CheckpointEngine`, `CheckpointEngineRegistry.register`) is put in its place. verl's own manager drives the same
backend in the verl stage on CPU (tests/integration/verl); what this adds is the GPU path: device buckets, CUDA IPC
and checksums computed on the GPU.

The weights are drawn per tensor and refit from a seed in each process (the ground truth, independent of reshard);
the harness world's gloo group carries the metadata and the topology between the two processes as JSON, the
driver's part (`build_topology`) runs on rank 0.
"""
from __future__ import annotations

import abc
import asyncio
import hashlib
import importlib.util
import sys
import time
import types
from typing import Any

import torch


def install_verl_stand_in() -> bool:
    """Put the two names the backend needs from `verl.checkpoint_engine` in place where verl is not installed."""
    if importlib.util.find_spec("verl") is not None:
        return False

    class CheckpointEngine(abc.ABC):  # noqa: B024 - verl's base class declares the methods; the backend has them
        pass

    class CheckpointEngineRegistry:
        engines: dict[str, type] = {}

        @classmethod
        def register(cls, name: str):
            def add(engine: type) -> type:
                cls.engines[name] = engine
                return engine
            return add

    verl = types.ModuleType("verl")
    engine = types.ModuleType("verl.checkpoint_engine")
    engine.CheckpointEngine, engine.CheckpointEngineRegistry = CheckpointEngine, CheckpointEngineRegistry
    verl.checkpoint_engine = engine
    sys.modules["verl"], sys.modules["verl.checkpoint_engine"] = verl, engine
    return True


def weight(name: str, shape: tuple[int, ...], dtype: torch.dtype, step: int) -> torch.Tensor:
    """Tensor `name` of refit `step`: drawn from a seed of the name and the step (every process draws the same)."""
    seed = int.from_bytes(hashlib.sha256(f"{name}/{step}".encode()).digest()[:8], "little") >> 1
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _all(value: Any, rank: int, size: int) -> list[Any]:
    from reshard.group_json import broadcast_json

    return [broadcast_json(value if r == rank else None, None, 120.0, f"rank {r}'s metadata", src=r)
            for r in range(size)]


def verl_rank(rank: int, size: int, args: dict[str, Any]) -> dict[str, Any]:
    """Rank 0: trainer rank 0 (verl's master); rank 1: a rollout rank. Refits 1 and 3 are clean; in refit 2 the
    trainer streams a tensor the model does not have after its last one. Returns, per refit, the error (if any),
    the groups handed on, whether every tensor handed on equals the seed's and the seconds."""
    stand_in = install_verl_stand_in()
    from reshard.executors.reference import torch_dtype
    from reshard.integrations.verl.engine import ReshardCheckpointEngine

    device = args.get("device", "cuda")  # "cpu": the same through POSIX shared memory (checks the job without a GPU)
    if device == "cuda":
        torch.cuda.set_device(0)
    trainer = rank == 0
    options = {"transport": args.get("transport", "shared"), "checksum": "sum64", "staging": args["staging"],
               "timeout": 60.0}
    engine = ReshardCheckpointEngine(args["bucket_size"], True if trainer else None, model=args["config"],
                                     device=device, **options)
    spec = engine.spec
    out: dict[str, Any] = {"stand_in": stand_in, "groups": len(engine.groups), "refits": []}
    for step in (1, 2, 3):
        metadata = _all(engine.prepare(), rank, size)
        topology = None
        if trainer:
            actor, rollout = ReshardCheckpointEngine.build_topology(1, 1, metadata)
            topology = [actor["topology"][0], rollout["topology"][0]]
        topology = _all(topology, rank, size)[0]
        engine.init_process_group(topology=topology[rank])
        entry: dict[str, Any] = {"step": step}
        start = time.perf_counter()
        try:
            if trainer:
                def stream():
                    for t in spec.tensors:
                        yield t.name, weight(t.name, tuple(t.shape), torch_dtype(t.dtype or spec.dtype), step).to(device)
                    if step == 2:
                        yield "model.layers.0.mlp.extra.weight", torch.zeros(4, device=device)
                asyncio.run(engine.send_weights(stream(), global_steps=step))
            else:
                wrong, handed = [], 0

                async def receive() -> None:
                    nonlocal handed
                    async for name, tensor in engine.receive_weights(global_steps=step):
                        t = spec.tensor(name)
                        want = weight(name, tuple(t.shape), torch_dtype(t.dtype or spec.dtype), step)
                        handed += 1
                        if tensor.device.type != device or not torch.equal(tensor.cpu(), want):
                            wrong.append(name)
                asyncio.run(receive())
                entry.update(handed=handed, wrong=wrong[:5])
        except Exception as e:  # noqa: BLE001 - reported to the test
            entry["error"] = f"{type(e).__name__}: {e}"
            if not trainer:
                entry.update(handed=handed, wrong=wrong[:5])
        entry["seconds"] = round(time.perf_counter() - start, 3)
        torch.distributed.barrier()  # verl's manager finalizes once every rank's update_weights returned
        engine.finalize()
        out["refits"].append(entry)
    out["tensors"] = len(spec.tensors)
    return out
