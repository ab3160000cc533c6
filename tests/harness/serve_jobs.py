"""Trainer processes that refit a running vLLM server, for tests and examples: a real megatron-core model on gloo
ranks (reshard.testing.megatron_cpu), loaded from an HF checkpoint, refit through `TrainerSession` into a server started
by harness.serve, then changed by a deterministic "training step" and refit again.

The step is elementwise (`train_step`), so it commutes with every sharding: the test applies the same function
to the HF checkpoint in its own process to get the trained model's checkpoint, independently of Megatron and of
reshard, and a server started from that checkpoint is the ground truth.

A job is JSON: {"tiny": TinyGPT fields, "tp", "pp", "ep", "etp", "url", "server_tp", "checkpoint", "transport",
"options", "steps", "out", "prompts", "fault", "from_checkpoint", "host"} ("host": where process 0 hosts the
refit's store; absent: discovered, reshard.addresses). Rank 0 writes `out`: per refit the version,
the server's greedy tokens, weight version and checksums, timings, and the plan-cache counts of this process; with
"from_checkpoint" (an empty directory) also a refit from a torch_dist checkpoint of the last refit's weights.
"""
from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from reshard.errors import ExecutionError


def train_step(t: torch.Tensor, step: int) -> torch.Tensor:
    """The deterministic stand-in for an optimizer step, elementwise (the same on any shard of a tensor)."""
    return t * 0.8 + 0.3 * torch.sin(3.0 * t + float(step))


def load_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        weights.update(load_file(str(f)))
    return weights


def save_checkpoint(weights: dict[str, torch.Tensor], config_dir: str | Path, out: str | Path) -> Path:
    """An HF checkpoint directory: `config_dir`'s config.json and `weights` as safetensors."""
    import shutil

    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(config_dir) / "config.json", out / "config.json")
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    return out


def make_checkpoint(tiny: Any, out: str | Path, seed: int = 0) -> Path:
    """A random HF checkpoint of the TinyGPT's architecture (transformers), every tensor drawn N(0, 1) so that a
    misplaced row changes the model's output."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny.hf_config(), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape))
    model.save_pretrained(out)
    return Path(out)


def refit_server(job: dict[str, Any]) -> None:
    """On every trainer rank (reshard.testing.megatron_cpu.run_ranks): build the model, load the checkpoint, refit the
    server `job["steps"]` times (a training step before each refit but the first)."""
    import torch.distributed as dist

    from reshard.adapters.megatron import derive_layout, read_model, source_tensors
    from reshard.adapters.refit import RefitSpec
    from reshard.adapters.server import VllmServer
    from reshard.adapters.trainer import TrainerSession
    from reshard.executors import shard
    from reshard.layouts import ModelSpec, VllmLayout
    from reshard.planner import cache
    from reshard.testing.megatron_cpu import TinyGPT, build_model, init_parallel

    rank = dist.get_rank()
    tiny = TinyGPT(**job["tiny"])
    init_parallel(job.get("tp", 1), job.get("pp", 1), job.get("ep", 1), job.get("etp"))
    chunks = build_model(tiny)
    spec = ModelSpec.from_hf_config(job["checkpoint"])  # the canonical model, as the server reads it
    facts = read_model(chunks)  # read once: the layout and the tensors come from the same facts
    layout = derive_layout(facts, spec)
    tensors = source_tensors(facts, layout)  # views of the live parameters
    mine = shard(layout, load_checkpoint(job["checkpoint"]), ranks=[rank])[rank]
    with torch.no_grad():
        for name, t in tensors.items():
            t.copy_(mine[name])
    server = VllmServer(job["url"]) if rank == 0 else None
    dst = VllmLayout(model=spec, tp=job.get("server_tp", 1))
    refit = RefitSpec.of(spec, layout, dst, install="loader", transport=job["transport"],
                         options=job.get("options", {}), config=job["checkpoint"])
    out: dict[str, Any] = {"layout": str(layout), "refits": []}
    session = TrainerSession(refit, rank, tensors, engines=[server] if server else [],
                             trainer_group=dist.group.WORLD, timeout=job.get("timeout", 300.0),
                             host=job.get("host"))  # None: this host's routable address, discovered
    stats = (lambda: server.collective_rpc("reshard_stats")) if server and job.get("worker_stats") else None
    if server is not None and job.get("fault", "").startswith("kill-server-"):
        _kill_server_when_updating(server, int(job["fault"].rsplit("-", 1)[1]), job["server_pid"])
    try:
        t0 = time.perf_counter()
        session.init()
        out["init_s"] = time.perf_counter() - t0
        out["rendezvous_host"] = session.rendezvous.host if session.rendezvous is not None else None
        out["compiles_after_init"] = cache.stats()["compiles"]
        out["worker_stats_after_init"] = stats() if stats else None
        for step in range(job.get("steps", 2)):
            if step:
                with torch.no_grad():
                    for t in tensors.values():
                        t.copy_(train_step(t, step))
            if job.get("fault") == f"trainer-exit-{step}" and rank == dist.get_world_size() - 1:
                os._exit(17)  # this trainer process dies as the refit begins: the server must fail and keep serving
            version = f"step-{step}"
            t0 = time.perf_counter()
            try:
                result = session.refit(version)
                entry: dict[str, Any] = {"version": version, "seconds": result.seconds, "phases": result.phases}
            except ExecutionError as e:
                entry = {"version": version, "error": str(e), "seconds": time.perf_counter() - t0}
            if server is not None and job.get("fault", "").startswith("kill-server-") and "error" in entry:
                out["refits"].append(entry)
                break
            if server is not None:
                entry.update(tokens=server.greedy(job["prompts"]), weight_version=server.weight_info(),
                             checksums=server.weight_checksums(), landed=_landed(server))
            out["refits"].append(entry)
            if "error" in entry:
                break
        out["compiles_after_refits"] = cache.stats()["compiles"]
        out["worker_stats_after_refits"] = stats() if stats else None
        if job.get("from_checkpoint") and out["refits"] and "error" not in out["refits"][-1]:
            out["from_checkpoint"] = _refit_from_checkpoint(job, chunks, tensors, session, server, spec, dst)
    except Exception:  # noqa: BLE001 - reported to the test
        out["exception"] = traceback.format_exc()
    finally:
        session.close()
    if rank == 0 or "exception" in out:
        path = Path(job["out"]) if rank == 0 else Path(job["out"]).with_suffix(f".rank{rank}.json")
        path.write_text(json.dumps(out, default=str))


def _refit_from_checkpoint(job: dict[str, Any], chunks: list, tensors: dict, session: Any, server: Any,
                           spec: Any, dst: Any) -> dict[str, Any]:
    """Issue 33 on a running server: the trainer saves its live model (the weights of its last refit) as a
    megatron-core torch_dist checkpoint in `job["from_checkpoint"]`, takes one more step and refits it (the
    server now serves other weights); then the same processes, as checkpoint readers (no model), refit the server
    from the checkpoint, each reading only the records of its part of the plan."""
    import torch.distributed as dist

    from reshard.adapters.megatron.checkpoint import open_checkpoint
    from reshard.adapters.megatron.checkpoint_layout import checkpoint_layout, checkpoint_tensors
    from reshard.adapters.refit import RefitSpec
    from reshard.adapters.trainer import TrainerSession
    from .megatron_ckpt import save_chunks

    step = job.get("steps", 2)
    saved_version = f"step-{step - 1}"
    save_chunks(chunks, job["from_checkpoint"])
    with torch.no_grad():
        for t in tensors.values():
            t.copy_(train_step(t, step))
    session.refit(f"step-{step}")
    before = {"tokens": server.greedy(job["prompts"])} if server is not None else {}
    session.close()
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = open_checkpoint(job["from_checkpoint"])
    refit = RefitSpec.of(spec, checkpoint_layout(ckpt, spec, readers=world), dst, install="loader",
                         transport=job["transport"], options=job.get("options", {}), config=job["checkpoint"])
    reader = TrainerSession(refit, rank, checkpoint_tensors(ckpt, refit.plan(), rank),
                            engines=[server] if server is not None else [], trainer_group=dist.group.WORLD,
                            timeout=job.get("timeout", 300.0))
    try:
        reader.init()
        result = reader.refit(f"checkpoint-{saved_version}")
    finally:
        reader.close()
    read = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(read, torch.tensor([ckpt.bytes_read], dtype=torch.int64))
    after: dict[str, Any] = {"version": f"checkpoint-{saved_version}", "seconds": result.seconds,
                             "bytes_read": [int(b) for b in read], "record_bytes": ckpt.record_bytes}
    if server is not None:
        after.update(tokens=server.greedy(job["prompts"]), weight_version=server.weight_info(),
                     checksums=server.weight_checksums(), landed=_landed(server))
    return {"before": before, "after": after}


def _landed(server: Any) -> list[dict[str, Any]] | None:
    """reshard's digest of what landed on each worker (servers with the worker extension), else None."""
    try:
        return server.landed()
    except ExecutionError:
        return None


def _kill_server_when_updating(server: Any, step: int, pid: int) -> None:
    """Fault injection: the server (its process group, started by the test) dies as refit `step` updates."""
    import signal

    calls = {"n": 0}
    update = server.update_weights

    def dying(update_info: Any) -> None:
        if isinstance(update_info, dict) and update_info.get("phase") == "install":
            return update(update_info)  # refits update twice (transfer, install): count the transfers
        calls["n"] += 1
        if calls["n"] > step:
            os.killpg(pid, signal.SIGKILL)
        update(update_info)

    server.update_weights = dying


__all__ = ["load_checkpoint", "make_checkpoint", "refit_server", "save_checkpoint", "train_step"]
