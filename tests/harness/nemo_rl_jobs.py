"""NeMo-RL's checkpoint-engine call order replayed on plain processes, for tests (never for production): the
engines of `reshard.integrations.nemo_rl` on T policy and R rollout processes (reshard.testing.world), the rollout side
collecting the batches vLLM would load. The vLLM side inside a real vLLM worker is examples/nemo_rl/refit.py.

What stands in for NeMo-RL (nemo_rl/weight_sync/checkpoint_engine_weight_synchronizer.py and the worker mixins,
at the commit in tests/data/nemo_rl_checkpoint_engine.json):
  - the driver's gathering of prepare() results: files in the job's folder, read in order (policy workers first);
  - the policy worker's iterator: the HF tensors of a checkpoint after `steps` training steps (serve_jobs.
    train_step), with an all-reduce among the policy processes per tensor (Megatron's export runs collectives);
    filtered by get_target_weight_layout() the way NeMo-RL's Megatron worker does (missing prefixes dropped,
    experts kept by id);
  - the vLLM worker: `async for batch in receive_weight_batches()`, each batch "loaded" into a dict.

A job is JSON: {"checkpoint" (an HF checkpoint directory) or "config" (an HF config dict: the weights are then
drawn per tensor from a seed, no transformers or safetensors needed), "policy", "rollout", "steps", "kwargs"
(engine keyword arguments besides `model`), or "engine_kwargs" (exactly the keyword arguments besides
`bucket_size`: what NeMo-RL builds from a config's refit_cfg entry), "bucket_size", "device" (where the policy's
tensors live; default CPU), "faults" ({step: fault}: what the last policy worker's stream does wrong at that step,
_faulty: "extra-first", "misshapen-middle", "extra-last"), "loader_faults" ({step: batch}: the first rollout
worker's loader raises on that batch), "first_load_seconds" (the loader takes that long on the first batch),
"release_after_refit" (finalize after every refit,
prepare and join again before the next, as NeMo-RL then does), "changed" (each step flips one ulp of this fraction
of the elements instead of serve_jobs.train_step's change of every element: delta refits), "dir"}.

Per refit each process reports what it saw: a policy worker the bytes it sent and what it keeps, a rollout worker
every batch it was yielded (names, and whether each tensor equals the checkpoint's), and either its error and the
time it raised (time.time(); the faulty worker records when it yielded the fault: one host, one clock).

Nothing here names a host: every engine finds its own address (reshard.addresses) where its process runs, so the
same job runs on one host or with the policy and rollout processes on different hosts (reshard.testing.world's `launch`).
A failure to construct an engine or to join is what NeMo-RL's driver sees from `ray.get` over every worker: every
process learns that one failed (the gathered outcomes) and stops; each reports its own error and how long it took.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

import torch


def _gather(job: dict[str, Any], key: str, rank: int, value: Any) -> list[Any]:
    """Every process's `value`, in process order (the driver's ray.get of every worker's result)."""
    import torch.distributed as dist

    folder = Path(job["dir"])
    tmp = folder / f"{key}-{rank}.tmp"
    tmp.write_text(json.dumps(value))
    tmp.rename(folder / f"{key}-{rank}.json")
    dist.barrier()
    return [json.loads((folder / f"{key}-{r}.json").read_text()) for r in range(dist.get_world_size())]


def _select(name: str, layout: dict[str, Any] | None) -> bool:
    """What NeMo-RL's Megatron policy worker keeps of its iterator given the engine's target layout (full tensors:
    every expert entry this engine writes has tp_size 1)."""
    if layout is None:
        return True
    if any(name.startswith(p) for p in layout["missing_weight_prefixes"]):
        return False
    parts = name.split(".")
    if ".mlp.experts." in name and parts[-1] == "weight" and parts[-2] in ("gate_proj", "up_proj", "down_proj"):
        block = name[:name.index(".mlp.experts.") + len(".mlp.experts")]
        leaf = "w2_weight" if parts[-2] == "down_proj" else "w13_weight"
        entry = layout["expert_params"].get(f"{block}.routed_experts.{leaf}")
        return entry is not None and int(parts[-3]) in entry["local_expert_ids"]
    return True


def nemo_rl_worker(rank: int, size: int, job: dict[str, Any]) -> dict[str, Any]:
    """One process of the job (reshard.testing.world): policy worker `rank` if rank < policy, else rollout worker
    rank - policy. Returns what it saw: per refit the bytes it sent or the batches it was yielded (checked against
    the checkpoint), and any error constructing or joining."""
    import torch.distributed as dist

    from reshard.executors.reference import torch_dtype
    from reshard.integrations.nemo_rl import ReshardCheckpointEngine
    from .serve_jobs import train_step
    from reshard.testing.world import new_group

    T = job["policy"]
    policy = new_group(list(range(T)))  # every process makes every group
    out: dict[str, Any] = {"refits": []}
    out["gloo_socket_ifname"] = os.environ.get("GLOO_SOCKET_IFNAME")  # the harness's device choice must not leak
    model = job.get("checkpoint") or job["config"]
    kwargs = job.get("engine_kwargs") or {"model": model, **job.get("kwargs", {})}
    engine = None
    try:  # NeMo-RL's init_checkpoint_engine on every worker
        engine = ReshardCheckpointEngine(bucket_size=job.get("bucket_size", 1 << 20), **kwargs)
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["construct_error"] = f"{type(e).__name__}: {e}"
    if any(_gather(job, "construct", rank, "construct_error" in out)):  # the driver's ray.get raises for all
        return out
    sent = torch_dtype(engine.spec.dtype)  # the policy exports in the dtype the engine was built for (its `dtype`)
    device = torch.device(job.get("device", "cpu"))
    base = {k: v.to(sent) for k, v in _weights(job, engine.spec).items()}
    out["groups"] = [list(g) for g in engine.groups]
    for step in range(1, job["steps"] + 1):
        if step == 1 or job.get("release_after_refit"):  # NeMo-RL then finalizes after every refit
            t0 = time.perf_counter()
            try:
                out["store_host"] = _meet(job, engine, rank, step)
            except Exception as e:  # noqa: BLE001 - reported to the test
                out["meet_error"] = f"{type(e).__name__}: {e}"
            out["meet_seconds"] = time.perf_counter() - t0
            if any(_gather(job, f"met{step}", rank, "meet_error" in out)):
                engine.finalize()
                return out
        if job.get("changed") is not None:  # a fraction of the elements changed by one ulp (delta refits)
            base = {k: _ulp_step(k, v, step, job["changed"]) for k, v in base.items()}
        else:
            base = {k: train_step(v, step) for k, v in base.items()}
        entry: dict[str, Any] = {"step": step}
        t0 = time.perf_counter()
        try:
            if rank < T:
                layout = engine.get_target_weight_layout()
                entry["layout"] = layout
                fault = (job.get("faults") or {}).get(str(step)) if rank == T - 1 else None
                weights = _policy_iterator(base, policy, device)
                stream = _faulty((w for w in weights if _select(w[0], layout)), fault, engine.spec, entry)
                asyncio.run(engine.send_weights(stream))
            else:
                fail_at = (job.get("loader_faults") or {}).get(str(step)) if rank == T else None
                asyncio.run(_receive(engine, base, entry, fail_at, job.get("first_load_seconds", 0.0)))
        except Exception as e:  # noqa: BLE001 - reported to the test
            entry["error_at"] = time.time()
            entry["error"] = f"{type(e).__name__}: {e}"
        entry.update(engine.last_refit)
        entry["seconds"] = time.perf_counter() - t0
        out["refits"].append(entry)
        dist.barrier()
        if job.get("release_after_refit"):
            engine.finalize()
    out["model_bytes"] = sum(t.numel() * t.element_size() for t in base.values())
    engine.finalize()
    return out


def _ulp_step(name: str, t: torch.Tensor, step: int, fraction: float) -> torch.Tensor:
    """`t` with the last bit of each element flipped with probability `fraction` (one ulp, as most of an RL step's
    changes at bf16 are), drawn from a seed of the name and the step: the same in every process."""
    import zlib

    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{step}".encode()))
    out = t.clone()
    bits = out.view(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()])
    bits[torch.rand(bits.numel(), generator=g) < fraction] ^= 1
    return out


def _weights(job: dict[str, Any], spec: Any) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, or (job["config"]) each tensor of the model drawn N(0, 1) from a seed of its own
    name: the same in every process, independent of reshard's planning and transport."""
    if job.get("checkpoint"):
        from .serve_jobs import load_checkpoint

        return load_checkpoint(job["checkpoint"])
    import zlib

    out = {}
    for t in spec.tensors:
        g = torch.Generator().manual_seed(zlib.crc32(t.name.encode()))
        out[t.name] = torch.randn(tuple(t.shape), generator=g)
    return out


def _meet(job: dict[str, Any], engine: Any, rank: int, step: int) -> str:
    """prepare on every engine, then every engine joins with all their metadata (policy workers first). Returns the
    address of the store everyone met at (policy worker 0's, as it published it)."""
    T, R = job["policy"], job["rollout"]
    mine: dict[str, Any] | None = None
    try:  # NeMo-RL's mixins add the worker's rank to a dict result; policy workers are processes 0..T-1
        mine, error = {**engine.prepare(), "rank": rank if rank < T else rank - T}, None
    except Exception as e:  # noqa: BLE001 - every process must reach the gathering, failed or not
        error = e
    gathered = _gather(job, f"prepare{step}", rank, {"metadata": mine, "error": repr(error) if error else None})
    if error is not None:
        raise error
    failed = [(k, g["error"]) for k, g in enumerate(gathered) if g["error"]]
    if failed:  # the driver's ray.get over every worker's prepare raises
        raise RuntimeError(f"prepare failed on process {failed[0][0]}: {failed[0][1]}")
    metadata = [g["metadata"] for g in gathered]
    topology = {"train_world_size": T, "rollout_world_size": R, "metadata": metadata}
    if rank < T:
        engine.init_policy_process_group(worker_rank=rank, **topology)
    else:
        engine.init_rollout_process_group(rollout_rank=rank - T, **topology)
    return metadata[0]["rendezvous"]["host"]


def _policy_iterator(weights: dict[str, torch.Tensor], group: Any, device: torch.device
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Whole HF tensors on every policy worker, with a collective per tensor (as Megatron's export has)."""
    import torch.distributed as dist

    for name, tensor in weights.items():
        token = torch.ones(1)
        dist.all_reduce(token, group=group)
        yield name, tensor.to(device, copy=True)


def _faulty(weights: Iterator[tuple[str, torch.Tensor]], fault: str | None, spec: Any,
            entry: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream with one fault (None: as it is): "extra-first", a tensor the model does not have before the
    model's own; "misshapen-middle", the tensor in the middle of the stream loses a row; "extra-last", a tensor
    the model does not have after the last one. Records in `entry` when the fault is yielded (time.time()) and
    which tensor it is."""
    extra = ("model.layers.0.mlp.extra.weight", torch.zeros(4))
    if fault == "extra-first":
        entry["fault_at"], entry["fault_tensor"] = time.time(), extra[0]
        yield extra
    middle = len(spec.tensors) // 2
    for i, (name, tensor) in enumerate(weights):
        if i == middle and fault == "misshapen-middle":
            entry["fault_at"], entry["fault_tensor"] = time.time(), name
            tensor = tensor[:-1]
        yield name, tensor
    if fault == "extra-last":
        entry["fault_at"], entry["fault_tensor"] = time.time(), extra[0]
        yield extra


async def _receive(engine: Any, want: dict[str, torch.Tensor], entry: dict[str, Any], fail_at: int | None,
                   first_load_seconds: float) -> None:
    """What vLLM's worker does with the batches, recorded in `entry` as they come (a failed refit raises after
    some): each batch's tensor names and size, and the names of tensors that differ from the checkpoint's
    (ground truth). `fail_at`: the loader raises on that batch (as vLLM's load_weights may), leaving the
    generator suspended, as NeMo-RL's `async for` does. `first_load_seconds`: loading the first batch takes that
    long (synchronously, as vLLM's loader blocks the event loop); when it ended is `first_loaded_at`."""
    entry["batches"], entry["wrong"] = [], []
    async for batch in engine.receive_weight_batches():
        entry["batches"].append({"names": [name for name, _ in batch], "bytes": sum(t.nbytes for _, t in batch)})
        entry["wrong"] += [name for name, t in batch if not torch.equal(t.cpu(), want[name])]
        if len(entry["batches"]) == 1 and first_load_seconds:
            time.sleep(first_load_seconds)
            entry["first_loaded_at"] = time.time()
        if fail_at is not None and len(entry["batches"]) == fail_at + 1:
            entry["fault_at"] = time.time()
            raise RuntimeError(f"the loader failed on batch {fail_at}")
    loaded = {name for b in entry["batches"] for name in b["names"]}
    entry["equal"] = not entry["wrong"] and loaded == set(want) and sum(len(b["names"]) for b in entry["batches"]) \
        == len(want)


__all__ = ["nemo_rl_worker"]
