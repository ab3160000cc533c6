"""Train-inference mismatch stage of `reshard validate`: the tiny megatron-core model of the hf parity stage
(TP=2 [EP=2], random weights) refit into a real `vllm serve` of the vLLM CPU build, and the two models' math
compared (reshard.verify): its token log-probabilities on a few sequences within the float32 thresholds before
(the server started fresh from the trainer's weights, which reshard's Megatron -> HF refit wrote) and after a refit,
and the slice-sensitivity audit of one tensor of each kind (every perturbed slice moves the engine as it moves
megatron-core). Needs megatron-core, transformers and the vLLM CPU virtualenv (one server, ~2 minutes to start).
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from ..layouts import ModelSpec


def mismatch_stage(spec: ModelSpec, tiny: dict[str, Any], python: str, timeout_s: float = 1500.0) -> str:
    from safetensors.torch import save_file

    from ..testing.serve import ServerProcess
    from ..testing.verify_jobs import verify_server
    from ..verify.checkpoint import random_sequences
    from .hf_parity import megatron_run, transformers_config
    from .megatron_side import run_layout

    layout, weights, _ = megatron_run(spec, tiny)
    with tempfile.TemporaryDirectory(prefix="reshard_validate_mismatch_") as tmp:
        ckpt = Path(tmp, "checkpoint")
        ckpt.mkdir()
        (ckpt / "config.json").write_text(json.dumps({**transformers_config(tiny), "torch_dtype": "float32"}))
        save_file({k: v.contiguous() for k, v in weights.items()}, str(ckpt / "model.safetensors"),
                  metadata={"format": "pt"})
        out = Path(tmp, "out.json")
        with ServerProcess(ckpt, tp=1, log=Path(tmp, "server.log"), python=python, max_model_len=64) as server:
            job = {"layout": layout.model_dump_json(), "hf": tiny, "checkpoint": str(ckpt), "url": server.url,
                   "sequences": random_sequences(spec.vocab_size, 4, 16), "out": str(out), "bugs": []}
            run_layout(layout, verify_server, job, timeout_s=timeout_s)
        result = json.loads(out.read_text())
    if "exception" in result:
        raise AssertionError(result["exception"].strip().splitlines()[-1])
    fresh, clean, audit = result["fresh"], result["clean"], result["audit_clean"]
    problems = [f"{what}: {', '.join(r['failures'])}" for what, r in (("fresh server", fresh), ("after refit", clean))
                if not r["ok"]]
    if audit["failed"]:
        problems.append(f"audit: slices that did not reach the engine as the trainer uses them: {audit['failed']}")
    if problems:
        raise AssertionError(f"{layout} -> vllm:tp=1 server: " + "; ".join(problems))
    ok = sum(e["status"] == "ok" for e in audit["entries"])
    return (f"{layout} -> vllm serve (CPU, fp32): after refit max |dlogp| {clean['max_abs']:.1e}, KL k3 "
            f"{clean['mean_k3']:.1e}, argmax {clean['argmax_agreement']:.3f} ({clean['tokens']} tokens; fresh server "
            f"max {fresh['max_abs']:.1e}); audit {ok}/{len(audit['entries'])} tensor kinds respond as in megatron-core")
