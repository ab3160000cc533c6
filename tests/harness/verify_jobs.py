"""Trainer processes that measure the train-inference mismatch of a running vLLM server (reshard.verify), for tests
and benchmarks: a real megatron-core model on gloo ranks, loaded from an HF checkpoint, refit into a server started
from that checkpoint, and refits with planted bugs.

A planted bug moves bytes wrongly on the way into the engine, as a wrong source layout (or plan) would: the trainer
session sends a staging copy of the live source tensors, refreshed from them before each refit; a bug rewrites the
staging copy (swaps two experts, the gate and up halves, two query heads, shifts a shard, or leaves the last
vocabulary rows stale), while the trainer model itself keeps the right weights. The mismatch check and the
slice-sensitivity audit must flag each one; a clean refit afterwards must pass again.

A job is JSON: {"tiny": TinyGPT fields and "tp", or "layout" (a MegatronLayout, JSON) and "hf" (the tiny HF
config of the validate stages' model), "url", "server_tp", "checkpoint", "sequences", "dtype", "out",
"bugs": [names of BUGS], "audit": [tensor names] or null (one of each kind), "controls": [tensor names audited
with each bug], "silent": [names of BUGS planted without a training step before them: a dropped slice whose stale
bytes equal the trainer's, which only the audit can see], "fresh_only": bool, "audit_clean": bool}.
"""
from __future__ import annotations

import json
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

Bug = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor], Any], str]


def _layer0(names: Any, suffix: str) -> str:
    hits = sorted(n for n in names if n.startswith("decoder.layers.0.") and n.endswith(suffix))
    if not hits:
        raise KeyError(f"no layer-0 tensor ending in {suffix}")
    return hits[0]


def swap_experts(staged: dict, live: dict, previous: dict, spec: Any) -> str:
    """Experts 0 and 1 of layer 0 exchange places (fc1 and fc2): a wrong expert map."""
    first = None
    for part in ("linear_fc1.weight", "linear_fc2.weight"):
        a = _layer0(staged, f"local_experts.0.{part}")
        b = a.replace("local_experts.0.", "local_experts.1.")
        staged[a].copy_(live[b])
        staged[b].copy_(live[a])
        first = first or a
    return first


def swap_gate_up(staged: dict, live: dict, previous: dict, spec: Any) -> str:
    """Layer 0's fc1 ([gate_r; up_r] on each rank) with its halves exchanged (expert 0's under MoE)."""
    name = _layer0(staged, "local_experts.0.linear_fc1.weight" if spec.num_experts else "mlp.linear_fc1.weight")
    half = staged[name].shape[0] // 2
    staged[name].copy_(torch.cat([live[name][half:], live[name][:half]]))
    return name


def swap_query_heads(staged: dict, live: dict, previous: dict, spec: Any) -> str:
    """Layer 0's fused QKV with the first two query heads of this rank's first group exchanged."""
    name = _layer0(staged, "self_attention.linear_qkv.weight")
    d = spec.head_dim
    staged[name][:d].copy_(live[name][d:2 * d])
    staged[name][d:2 * d].copy_(live[name][:d])
    return name


def shift_shard(staged: dict, live: dict, previous: dict, spec: Any) -> str:
    """Layer 0's attention output projection (row-parallel: each rank holds a column block) shifted by one
    column inside each rank's shard: a shard placed at the wrong offset."""
    name = _layer0(staged, "self_attention.linear_proj.weight")
    staged[name].copy_(torch.roll(live[name], 1, dims=1))
    return name


def drop_last_vocab_rows(staged: dict, live: dict, previous: dict, spec: Any, rows: int = 8) -> str:
    """The output layer's last `rows` canonical vocabulary rows are not sent: the engine keeps the previous ones
    (a wrong vocabulary padding)."""
    name = "output_layer.weight"
    if name in staged:
        mask = _dropped_mask(spec.vocab_size, staged[name].shape[0], rows)
        staged[name][mask] = previous[name][mask]
    return name


BUGS: dict[str, Bug] = {"swap experts": swap_experts, "swap gate/up": swap_gate_up,
                        "swap query heads": swap_query_heads, "shift shard": shift_shard,
                        "drop last vocab rows": drop_last_vocab_rows}


def verify_server(job: dict[str, Any]) -> None:
    """On every trainer rank (reshard.testing.megatron_cpu.run_ranks): see the module docstring. Rank 0 writes `out`."""
    import torch.distributed as dist

    from reshard.adapters.megatron import derive_layout, read_model, source_tensors
    from reshard.adapters.refit import RefitSpec
    from reshard.adapters.server import VllmServer
    from reshard.adapters.trainer import TrainerSession
    from reshard.executors import shard
    from reshard.layouts import ModelSpec, VllmLayout
    from reshard.verify import audit, measure
    from reshard.testing.megatron_cpu import TinyGPT, build_model, init_parallel
    from .serve_jobs import load_checkpoint, train_step

    rank = dist.get_rank()
    dtype = job.get("dtype", "float32")
    spec = ModelSpec.from_hf_config(job["checkpoint"])
    if "tiny" in job:  # a reshard.testing.megatron_cpu model
        init_parallel(job.get("tp", 1))
        chunks = build_model(TinyGPT(**job["tiny"]), getattr(torch, dtype))
        facts = read_model(chunks)
        layout = derive_layout(facts, spec)
        live = source_tensors(facts, layout)
    else:  # the validate stages' model of a tiny config (validate.megatron_side)
        from reshard.layouts import MegatronLayout
        from reshard.validate.hf_parity import INIT_STD
        from reshard.validate.megatron_side import build_gpt

        layout = MegatronLayout.model_validate_json(job["layout"])
        chunks = [build_gpt(layout, job["hf"], init_std=INIT_STD)]
        live = source_tensors(chunks[0], layout)
    mine = shard(layout, load_checkpoint(job["checkpoint"]), ranks=[rank])[rank]
    with torch.no_grad():
        for name, t in live.items():
            t.copy_(mine[name])
    server = VllmServer(job["url"]) if rank == 0 else None
    seqs, vocab = job["sequences"], spec.vocab_size
    out: dict[str, Any] = {"layout": str(layout), "names": sorted(live)}
    try:
        t0 = time.perf_counter()
        out["fresh"] = measure(chunks, server, seqs, vocab_size=vocab, dtype=dtype).to_dict()
        out["measure_s"] = time.perf_counter() - t0
        if job.get("fresh_only"):
            return
        staged = {n: t.detach().clone() for n, t in live.items()}
        refit = RefitSpec.of(spec, layout, VllmLayout(model=spec, tp=job.get("server_tp", 1)), install="loader",
                             transport="collective")
        session = TrainerSession(refit, rank, staged, engines=[server] if server else [],
                                 trainer_group=dist.group.WORLD, timeout=300.0)
        session.init()
        state = {"bug": None, "n": 0}

        def do_refit() -> None:
            with torch.no_grad():
                previous = {n: t.clone() for n, t in staged.items()}
                for n, t in live.items():
                    staged[n].copy_(t)
                if state["bug"] is not None:
                    state["tensor"] = BUGS[state["bug"]](staged, live, previous, spec)
            state["n"] += 1
            session.refit(f"v{state['n']}")

        t0 = time.perf_counter()
        do_refit()
        out["refit_s"] = time.perf_counter() - t0
        out["clean"] = measure(chunks, server, seqs, vocab_size=vocab, dtype=dtype).to_dict()
        if job.get("audit_clean", True):
            t0 = time.perf_counter()
            out["audit_clean"] = audit(chunks, live, do_refit, server, seqs, vocab_size=vocab, dtype=dtype,
                                       names=job.get("audit")).to_dict()
            out["audit_s"] = time.perf_counter() - t0
        out["bugs"], out["silent"] = {}, {}
        planted = [(b, True) for b in job.get("bugs", [])] + [(b, False) for b in job.get("silent", [])]
        for step, (bug, moved) in enumerate(planted, start=1):
            if moved:  # the trainer moves on, so rows the refit leaves stale differ from the trainer's
                with torch.no_grad():
                    for t in live.values():
                        t.copy_(train_step(t, step) * 0.5 + t * 0.5)
            # else the bug is silent when the engine's stale bytes equal the trainer's: only the audit can see it
            state["bug"] = bug
            do_refit()
            named = state["tensor"]
            found = {"tensor": named,
                     "mismatch": measure(chunks, server, seqs, vocab_size=vocab, dtype=dtype).to_dict()}
            found["audit"] = audit(chunks, live, do_refit, server, seqs, vocab_size=vocab, dtype=dtype,
                                   names=[named, *job.get("controls", [])]).to_dict()
            state["bug"] = None
            do_refit()
            found["restored"] = measure(chunks, server, seqs, vocab_size=vocab, dtype=dtype).to_dict()
            out["bugs" if moved else "silent"][bug] = found
        session.close()
    except Exception:  # noqa: BLE001 - reported to the test
        out["exception"] = traceback.format_exc()
    finally:
        if rank == 0 or "exception" in out:
            path = Path(job["out"]) if rank == 0 else Path(job["out"]).with_suffix(f".rank{rank}.json")
            path.write_text(json.dumps(out, default=str))


def _dropped_mask(vocab_size: int, local: int, rows: int = 8) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    idx = torch.arange(local) + ps.get_tensor_model_parallel_rank() * local
    return (idx >= vocab_size - rows) & (idx < vocab_size)


__all__ = ["BUGS", "verify_server"]
