"""Jobs for `reshard.testing.world`: quantizing refits across real processes (gloo, or NCCL on GPUs), checked against an
independently quantized checkpoint (`harness.fp8_reference`).

A case is JSON: {"config": an HF config dict, "src": a layout string, "dst": a layout string, "block": [bn, bk],
"binding": {"src": [...], "dst": [...]}, "seed": int, "options": executor options, "kill": optional {"victim":
process, "at_round": n}}. Every process compiles the same FP8 plan, builds the same bf16 weights from the seed,
shards the source ranks it plays, fills its destination tensors (the FP8 engine's: fp8 weights, float32 scales,
the rest bf16) with a sentinel, refits once through `Fp8Executor` over the distributed executor and compares its
destination tensors byte for byte with the reference checkpoint laid out by the destination. With "kill", a
second refit from other weights loses process `victim` at round `at_round`: the survivors must raise and keep
the first refit's weights and scales, both.
"""
from __future__ import annotations

import os
import traceback
from typing import Any

import torch
import torch.distributed as dist

from reshard.errors import ExecutionError
from reshard.executors.binding import Binding
from reshard.executors.fp8 import Fp8Executor
from reshard.executors.reference import allocate, shard
from reshard.layouts import ModelSpec, parse_layout
from reshard.executors.base import RankTensors
from reshard.layouts.fp8 import FP8, Fp8Scheme
from reshard.planner.fp8 import Fp8Plan, compile_fp8
from .fp8_reference import reference_checkpoint, same_bytes

SENTINEL = -7.0


def execute_fp8_local(fp: Fp8Plan, src: RankTensors, dst: RankTensors) -> None:
    """One quantizing refit with every rank in this process."""
    Fp8Executor(fp, None, 0, src, dst, inner="reference").refit()


def _weights(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {t.name: (torch.randn(t.shape, generator=g) * 0.05).to(torch.bfloat16) for t in spec.tensors}


def run_cases(rank: int, size: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    """Every case of `args["cases"]` in turn (one world); one result per case."""
    out = []
    for case in args["cases"]:
        out.append(run_case(rank, size, case))
        dist.barrier()
    return out


def run_case(rank: int, size: int, args: dict[str, Any]) -> dict[str, Any]:
    try:
        spec = ModelSpec.from_hf_config(args["config"])
        fp = compile_fp8(parse_layout(args["src"], spec), parse_layout(args["dst"], spec),
                         Fp8Scheme(block=tuple(args["block"])), colocated=args.get("colocated", False))
        binding = Binding.from_dict(args["binding"])
        mine_src, mine_dst = list(binding.src_ranks_of(rank)), list(binding.dst_ranks_of(rank))
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend()).lower() \
            else torch.device("cpu")
        weights = _weights(spec, args["seed"])
        src = {r: {n: t.to(device) for n, t in ts.items()}
               for r, ts in shard(_own(fp), weights, ranks=mine_src).items()}
        dst = {r: {n: t.to(device) for n, t in ts.items()}
               for r, ts in allocate(fp.full_dst, SENTINEL, ranks=mine_dst).items()}
        kill = args.get("kill")

        def on_round(index: int) -> None:
            if kill and state["refits"] == 1 and rank == kill["victim"] and index >= kill["at_round"]:
                os._exit(17)

        state = {"refits": 0}
        options = dict(args.get("options", {}), **({"on_round": on_round} if kill else {}))
        ex = Fp8Executor(fp, binding, rank, src, dst, inner="collective", group=dist.group.WORLD, **options)
        ex.refit()
        state["refits"] = 1
        quantized = {t.name for t in fp.full_dst.model.tensors if t.dtype == FP8}
        want = shard(fp.full_dst, reference_checkpoint(weights, quantized, fp.scheme.block), fill=SENTINEL,
                     ranks=mine_dst)
        wrong = [f"destination rank {r} {n!r}" for r, ts in dst.items() for n, t in ts.items()
                 if not same_bytes(t, want[r][n])]
        out: dict[str, Any] = {"ok": not wrong, "error": "; ".join(wrong[:5]), "has_dst": bool(dst),
                               "quantize_jobs": len(ex.senders.jobs), "receiver_jobs": len(ex.receivers.jobs)}
        if kill:
            new = _weights(spec, args["seed"] + 1)
            for r, ts in shard(_own(fp), new, ranks=mine_src).items():
                for n, t in ts.items():
                    src[r][n].copy_(t)
            try:
                ex.refit()
                out["second"] = "finished"
            except ExecutionError as e:
                out["second"] = f"ExecutionError: {str(e)[:200]}"
            out["kept_first"] = all(same_bytes(t, want[r][n]) for r, ts in dst.items() for n, t in ts.items())
        return out
    except Exception as e:  # reported to the test, which fails with it
        return {"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}


def _own(fp):
    """The source layout over the model's own (bf16) spec: what the trainer's tensors are laid out by."""
    src = fp.plan.src
    return type(src).model_validate({**src.model_dump(), "model": fp.model})


def store_worker(process: int, port: int, workdir: str) -> None:
    """`harness.store_procs.launch` target: every case of workdir/cases.json through Fp8Executor around the
    case's store-made executor ("nixl" or "shared"), twice with new weights; workdir/result-<process>.json says,
    per case, whether this process's engine tensors equal the reference checkpoint each time."""
    import json as _json
    from pathlib import Path as _Path

    from .store_procs import _client

    torch.set_num_threads(1)
    store = _client(port)
    results = []
    for k, case in enumerate(_json.loads((_Path(workdir) / "cases.json").read_text())):
        out: dict[str, Any] = {"case": k, "ok": [], "error": ""}
        try:
            spec = ModelSpec.from_hf_config(case["config"])
            fp = compile_fp8(parse_layout(case["src"], spec), parse_layout(case["dst"], spec),
                             Fp8Scheme(block=tuple(case["block"])))
            binding = Binding.from_dict(case["binding"])
            mine_src, mine_dst = list(binding.src_ranks_of(process)), list(binding.dst_ranks_of(process))
            src = shard(_own(fp), _weights(spec, case["seed"]), ranks=mine_src)
            dst = allocate(fp.full_dst, SENTINEL, ranks=mine_dst)
            options = dict(case["options"], store=store, namespace=f"fp8case{k}")
            if case["executor"] == "nixl":
                from reshard.executors.nixl import NixlOptions

                options["options"] = NixlOptions(**options.pop("nixl", {}))
            ex = Fp8Executor(fp, binding, process, src, dst, inner=case["executor"], **options)
            quantized = {t.name for t in fp.full_dst.model.tensors if t.dtype == FP8}
            for r in range(2):
                w = _weights(spec, case["seed"] + r)
                for rank, ts in shard(_own(fp), w, ranks=mine_src).items():
                    for n, t in ts.items():
                        src[rank][n].copy_(t)
                ex.refit()
                want = shard(fp.full_dst, reference_checkpoint(w, quantized, fp.scheme.block), fill=SENTINEL,
                             ranks=mine_dst)
                out["ok"].append(all(same_bytes(t, want[rr][n]) for rr, ts in dst.items() for n, t in ts.items()))
            ex.close()
        except Exception as e:  # noqa: BLE001 - reported to the test
            out["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
        results.append(out)
    (_Path(workdir) / f"result-{process}.json").write_text(_json.dumps(results))
