"""Refit a running vLLM server from Megatron trainer processes, the way ART runs vLLM: the server in its own
virtualenv (the vLLM CPU build, its own torch), the trainer in this one, which has no vLLM.

    .venv/bin/python examples/art/refit.py [--transport collective|shared|nixl] [--tp 2] [--pp 2] [--server-tp 1]

What a user writes is `trainer()`: each trainer process reads its live megatron-core model
(`reshard.adapters.megatron`), declares the refit (`RefitSpec`: the model, the trainer's layout, the server's, how
the bytes are installed and moved), and a `TrainerSession` refits the server (`VllmServer`, vLLM's weight-sync
HTTP routes) after every training step; the server runs `vllm serve --weight-transfer-config '{"backend":
"reshard"}'` (serve.py).

1. makes a tiny Qwen3 checkpoint A (transformers) and the checkpoint B of the weights after one "training step"
   (an elementwise function, applied here to A's tensors: ground truth independent of Megatron and reshard);
2. starts `vllm serve` on B (with the reshard worker extension) and records its greedy tokens and vLLM's own
   weight checksums;
3. starts TP x PP megatron-core trainer processes on gloo, loaded with A; they refit the server with A (its
   tokens must change), take the training step (now they hold B) and refit again; every refit is pause, start,
   update (every trainer process sends its own shards to the server's workers), finish, resume;
4. after each refit, every trainer process scores a few sequences with its megatron-core model and rank 0 compares
   the server's prompt log-probabilities (reshard.verify.measure: the train-inference mismatch, printed);
5. exits 0 only if every mismatch is within the float32 thresholds, the server's tokens after the second refit
   equal those it had when started on B, reshard's
   digest of every tensor that landed on every worker (before vLLM repacks it) equals checkpoint B's file, and its
   weight version is the one the trainer sent. (vLLM's own /weight_checker checksums are compared too, but the CPU
   build hashes repacked parameters as empty input: they cannot see those.)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from reshard.ports import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import VllmServe, vllm_python  # noqa: E402 - this folder's launcher of `vllm serve`

PROMPTS = [[1, 2, 3, 4, 5], [17, 40, 3, 99], [64, 65, 66, 7, 7, 7, 7, 80]]
MISMATCH_SEQUENCES = 3  # x 16 tokens, scored by both sides after each refit
SIZES = dict(vocab_size=128, hidden_size=64, num_layers=4, heads=4, kv_heads=2, head_dim=32, ffn=96)


def train_step(t: torch.Tensor, step: int) -> torch.Tensor:
    """The stand-in for an optimizer step (elementwise: the same on every shard of a tensor)."""
    return t * 0.8 + 0.3 * torch.sin(3.0 * t + float(step))


def make_checkpoints(work: Path) -> tuple[Path, Path]:
    """A: a tiny random Qwen3 (every weight N(0, 1): a misplaced element changes the tokens); B: A after a step."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, Qwen3Config

    s = SIZES
    config = Qwen3Config(vocab_size=s["vocab_size"], hidden_size=s["hidden_size"], num_hidden_layers=s["num_layers"],
                         num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
                         intermediate_size=s["ffn"], max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape))
    model.save_pretrained(work / "A")
    model.config.save_pretrained(work / "B")
    save_file({k: train_step(v, 1).contiguous() for k, v in load_file(str(work / "A/model.safetensors")).items()},
              str(work / "B/model.safetensors"))
    return work / "A", work / "B"


def build_megatron_model(tp: int, pp: int) -> Any:
    """The trainer's model: a megatron-core GPTModel of the checkpoint's architecture, on CPU (gloo)."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    s = SIZES
    config = TransformerConfig(
        num_layers=s["num_layers"], hidden_size=s["hidden_size"], num_attention_heads=s["heads"],
        num_query_groups=s["kv_heads"], kv_channels=s["head_dim"], ffn_hidden_size=s["ffn"], normalization="RMSNorm",
        layernorm_epsilon=1e-6, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        qk_layernorm=True, use_cpu_initialization=True, params_dtype=torch.float32,
        pipeline_dtype=torch.float32 if pp > 1 else None, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=True,
                                                                                    normalization="RMSNorm"),
                    vocab_size=s["vocab_size"], max_sequence_length=256, pre_process=ps.is_pipeline_first_stage(),
                    post_process=ps.is_pipeline_last_stage(), share_embeddings_and_output_weights=False,
                    position_embedding_type="rope", rotary_base=10_000)  # the checkpoint's rope_theta


def trainer(rank: int, job: dict[str, Any]) -> None:
    """One trainer process: build the model, load A, refit the server, take a step, refit again."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    import reshard
    from reshard.adapters import RefitSpec, TrainerSession, VllmServer
    from reshard.adapters.megatron import derive_layout, read_model, source_tensors
    from reshard.executors import shard
    from reshard.verify import measure, random_sequences

    # --8<-- [start:trainer]
    model = build_megatron_model(job["tp"], job["pp"])
    # the canonical model, as the server reads it; it also carries the config's fields that change the math but
    # no shape (spec.math: MoE top-k, norm epsilon, rope, activation), which the refit sends to the server: a server
    # whose model is configured otherwise refuses at init, before any byte moves
    spec = reshard.ModelSpec.from_hf_config(job["checkpoint"])
    facts = read_model([model])
    layout = derive_layout(facts, spec)  # the MegatronLayout this process's model is in
    tensors = source_tensors(facts, layout)  # views of the live parameters: what this process sends
    mine = shard(layout, load_file(str(Path(job["checkpoint"]) / "model.safetensors")), ranks=[rank])[rank]
    with torch.no_grad():  # load A (a real trainer would load its checkpoint its own way)
        for name, t in tensors.items():
            t.copy_(mine[name])
    server = VllmServer(job["url"]) if rank == 0 else None
    refit = RefitSpec.of(spec, layout, reshard.VllmLayout(model=spec, tp=job["server_tp"]), install="loader",
                         transport=job["transport"])  # refit.math: spec.math, checked by every server worker
    session = TrainerSession(refit, rank, tensors, engines=[server] if server else [],
                             trainer_group=dist.group.WORLD)
    out: dict[str, Any] = {"layout": str(layout), "refits": []}
    session.init()
    try:
        for step in range(2):
            if step:
                with torch.no_grad():  # the training step, on this process's shards
                    for t in tensors.values():
                        t.copy_(train_step(t, step))
            result = session.refit(version=f"step-{step}")
            # the train-inference mismatch: every trainer process scores, rank 0 asks the server
            mismatch = measure([model], server, random_sequences(spec.vocab_size, MISMATCH_SEQUENCES, 16),
                               vocab_size=spec.vocab_size, dtype="float32")
            if server is not None:
                out["refits"].append({"mismatch": mismatch.to_dict(), "mismatch_text": str(mismatch),
                                      "version": result.version, "phases": result.phases,
                                      "seconds": result.seconds, "pause_s": result.stats.pause_s,
                                      "tokens": server.greedy(PROMPTS), "weight_version": server.weight_info(),
                                      "checksums": server.weight_checksums(), "landed": server.landed()})
    finally:
        session.close()
    # --8<-- [end:trainer]
    if rank == 0:
        Path(job["out"]).write_text(json.dumps(out))


def _process(rank: int, world: int, port: int, job: dict[str, Any]) -> None:
    import datetime

    import torch.distributed as dist

    import warnings

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
    warnings.simplefilter("ignore")  # megatron-core warns about missing Apex / TransformerEngine on CPU
    torch.set_num_threads(1)
    torch.cuda.current_device = lambda: "cpu"  # megatron-core 0.19 asks CUDA for a device in a few places
    from megatron.core.tensor_parallel import random as tp_random

    tp_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()  # no CUDA RNG on CPU
    torch.Tensor.cuda = lambda self, *a, **k: self  # the forward moves a few tensors "to CUDA": here, the CPU
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    trainer(rank, job)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transport", default="collective", choices=["collective", "shared", "nixl"])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--server-tp", type=int, default=1)
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    if not vllm_python().exists():
        print(f"no vLLM CPU virtualenv at {vllm_python()}: run scripts/bootstrap vllm first", file=sys.stderr)
        return 2
    import torch.multiprocessing as mp

    work = Path(args.workdir or tempfile.mkdtemp(prefix="reshard-art-"))
    a, b = make_checkpoints(work)
    t0 = time.perf_counter()
    extension = ("--worker-extension-cls", "reshard.adapters.vllm.worker.ReshardWorkerExtension")  # server.landed()
    with VllmServe(vllm_python(), b, tp=args.server_tp, log=work / "server.log", extra_args=extension) as server:
        print(f"server {server.url} (tp={args.server_tp}) healthy after {time.perf_counter() - t0:.0f} s; "
              f"log {work / 'server.log'}")
        fresh, checksums = server.greedy(PROMPTS), server.weight_checksums()
        port = free_port()
        job = {"tp": args.tp, "pp": args.pp, "url": server.url, "server_tp": args.server_tp, "checkpoint": str(a),
               "transport": args.transport, "out": str(work / "trainer.json")}
        mp.start_processes(_process, args=(args.tp * args.pp, port, job), nprocs=args.tp * args.pp, join=True,
                           start_method="spawn")
    out = json.loads((work / "trainer.json").read_text())
    print(f"trainer {out['layout']} -> vllm:tp={args.server_tp} over {args.transport!r}")
    for r in out["refits"]:
        phases = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in r["phases"].items())
        print(f"  refit {r['version']}: {r['seconds'] * 1e3:.0f} ms, paused {r['pause_s'] * 1e3:.0f} ms ({phases}); "
              f"server weight version {r['weight_version']!r}")
        print(f"    {r['mismatch_text']}")
    from safetensors.torch import load_file

    from reshard.executors.checksum import tensor_digests

    first, last = out["refits"][0], out["refits"][-1]
    checks = {
        "the train-inference mismatch after every refit is within the float32 thresholds":
            all(r["mismatch"]["ok"] for r in out["refits"]),
        "refit with the weights before the step changed the tokens": first["tokens"] != fresh,
        "tokens after the step's refit equal the server's when started on B": last["tokens"] == fresh,
        "reshard's digests of what landed on every worker equal checkpoint B's": bool(last["landed"]) and all(
            w["installed"] and w["digests"] == tensor_digests(load_file(str(b / "model.safetensors")))
            for w in last["landed"]),
        "vLLM's weight checksums equal the server's when started on B (blind to repacked parameters)":
            last["checksums"] == checksums,
        "the server reports the version the trainer sent": last["weight_version"] == last["version"],
    }
    for what, ok in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {what}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
