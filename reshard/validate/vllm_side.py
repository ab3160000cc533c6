"""Run inside the vLLM virtualenv: build one vLLM model from an HF config (dummy weights, no engine, gloo, CPU)
and print its named parameters per TP rank as JSON. What the vLLM layout-parity stage compares with the
declared VllmLayout. Usage: python -m reshard.validate.vllm_side CONFIG [--ep]  (TP=1; one process)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile


def named_parameters(config_path: str, ep: bool = False) -> dict[str, list[int]]:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    with tempfile.TemporaryDirectory() as ckpt:
        shutil.copy(config_path, os.path.join(ckpt, "config.json"))
        cfg = EngineArgs(model=ckpt, tensor_parallel_size=1, enable_expert_parallel=ep, dtype="bfloat16",
                         skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
                         load_format="dummy", language_model_only=True).create_engine_config()
        # language_model_only: a multimodal wrapper (Qwen3.5) builds no vision tower, which refits leave out
        with set_current_vllm_config(cfg):
            init_distributed_environment(world_size=1, rank=0, distributed_init_method="env://", local_rank=0,
                                         backend="gloo")
            initialize_model_parallel(tensor_model_parallel_size=1, backend="gloo")
            with set_default_torch_dtype(cfg.model_config.dtype):
                model = initialize_model(cfg)
            out = {n: list(p.shape) for n, p in model.named_parameters()}
            out.update({n: list(b.shape) for n, b in model.named_buffers()
                        if n.endswith("e_score_correction_bias")})
            return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--ep", action="store_true")
    args = ap.parse_args()
    params = named_parameters(args.config, args.ep)
    sys.stdout.write("RESHARD_JSON " + json.dumps({"0": params}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
