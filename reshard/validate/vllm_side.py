"""Run inside the vLLM virtualenv, one process per TP rank (RANK / WORLD_SIZE / MASTER_* in the environment):
build vLLM models from HF configs without an engine (gloo, CPU) and print one `RESHARD_JSON [...]` line, an entry
per config (one process checks several: start-up is most of a check's time).

  python -m reshard.validate.vllm_side CONFIG...             named parameters (vllm layout stage; TP=1)
  python -m reshard.validate.vllm_side CONFIG... --load-parity [--perturb INDEX=NAME]... [--dtype bfloat16]
      random HF weights by vLLM's load_weights, then by reshard's direct and loader installs: the parameters
      whose bytes differ. --perturb corrupts tensor NAME of config INDEX on reshard's side.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import Any, Callable, Iterator

SEED = 11


def vllm_models(config_paths: list[str], dtype: str = "bfloat16") -> Iterator[tuple[Any, Callable[[], Any], int]]:
    """Per config in turn: (its vLLM config, a builder of this rank's model, this rank), the config current while
    it is used. vLLM's distributed state over gloo is set up at the first config, its groups anew at each."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    from vllm.config import set_current_vllm_config
    from vllm.distributed import destroy_model_parallel, init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    with tempfile.TemporaryDirectory() as tmp:
        for i, config_path in enumerate(config_paths):
            ckpt = os.path.join(tmp, str(i))
            os.makedirs(ckpt)
            shutil.copy(config_path, os.path.join(ckpt, "config.json"))
            # language_model_only: a multimodal wrapper (Qwen3.5) builds no vision tower, which refits leave out
            cfg = EngineArgs(model=ckpt, tensor_parallel_size=world, dtype=dtype,
                             skip_tokenizer_init=True, enforce_eager=True, max_model_len=128, load_format="dummy",
                             distributed_executor_backend="external_launcher" if world > 1 else None,
                             language_model_only=True).create_engine_config()
            with set_current_vllm_config(cfg):
                if i:  # the groups follow the config (an expert-parallel group only for MoE): anew
                    destroy_model_parallel()
                else:
                    init_distributed_environment(world_size=world, rank=rank, distributed_init_method="env://",
                                                 local_rank=rank, backend="gloo")
                initialize_model_parallel(tensor_model_parallel_size=world, backend="gloo")

                def build(cfg: Any = cfg) -> Any:
                    with set_default_torch_dtype(cfg.model_config.dtype):
                        return initialize_model(cfg)

                yield cfg, build, rank


def named_parameters(cfg: Any, build: Callable[[], Any], rank: int) -> dict[str, list[int]]:
    """Name -> shape of the parameters (and DeepSeek-V3's score-correction buffers) this rank's model has."""
    model = build()
    out = {n: list(p.shape) for n, p in model.named_parameters()}
    out.update({n: list(b.shape) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    return out


def poison(model: Any) -> None:
    """Fill every weight of a vLLM model with NaN, so that a byte an install misses shows."""
    import torch

    from ..adapters.vllm.live import weights

    with torch.no_grad():
        for p in weights(model).values():
            p.fill_(float("nan"))


def load_parity(cfg: Any, build: Callable[[], Any], rank: int, perturb: str | None = None) -> dict[str, Any]:
    """This rank's comparison of vLLM's load_weights with reshard's direct and loader installs (random HF
    weights): the parameters that differ, or the error of a refused declared layout."""
    import torch
    from vllm.config import set_current_vllm_config

    from ..adapters.vllm import LoaderInstaller, bind_direct, loader_layout
    from ..errors import ReshardError
    from ..adapters.vllm.live import declared_layout, spec_of, weights
    from ..executors import ReferenceExecutor, shard
    from ..executors.reference import torch_dtype
    from ..layouts import HfLayout
    from ..planner import compile_plan
    from .hf_parity import perturbed

    spec = spec_of(cfg)
    gen = torch.Generator().manual_seed(SEED)  # the same weights on every rank
    hf = {t.name: torch.randn(t.shape, generator=gen).to(torch_dtype(t.dtype or spec.dtype)) for t in spec.tensors}
    # One instance (a second cannot be built under this config): vLLM's loader first, its result kept; then
    # every parameter poisoned and reshard's install into the same storage.
    model = build()
    poison(model)
    with set_current_vllm_config(cfg), torch.no_grad():
        model.load_weights(iter([(k, v.clone()) for k, v in hf.items()]))
    want = {n: p.detach().clone() for n, p in weights(model).items()}
    poison(model)

    layout = declared_layout(spec, cfg)
    try:
        binding = bind_direct(model, layout, rank, None, cfg)  # checks structure and loaders first
    except ReshardError as exc:  # the model refuses the declared layout: every problem, as a result
        return {"rank": rank, "layout": str(layout), "error": str(exc)}
    source = HfLayout(model=spec)
    src = shard(source, perturbed(hf, perturb) if perturb else hf)
    ReferenceExecutor(compile_plan(source, layout), None, 0, src, {rank: binding.tensors}).refit()
    binding.finish()

    def differing() -> list[str]:
        got = weights(model)
        out = sorted(set(want) ^ set(got))
        for name in sorted(set(want) & set(got)):
            a, b = want[name].detach().contiguous(), got[name].detach().contiguous()
            if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                out.append(name)
        return out

    differ = differing()
    # the loader install too: canonical tensors received whole, then handed to load_weights per layer group
    poison(model)
    plan = compile_plan(source, loader_layout(spec, cfg.parallel_config.world_size))
    installer = LoaderInstaller(model, rank, plan, cfg)
    ReferenceExecutor(plan, None, 0, src, {rank: installer.buffers}).refit()
    installer.load()
    differ += [f"{name} (loader install)" for name in differing()]
    return {"rank": rank, "layout": str(layout), "params": len(want), "differ": differ,
            "bytes": sum(p.numel() * p.element_size() for p in want.values())}


def main() -> int:
    """The command line of the module docstring."""
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--load-parity", action="store_true")
    ap.add_argument("--perturb", action="append", default=[], metavar="INDEX=NAME")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    perturb = {int(i): name for i, name in (p.split("=", 1) for p in args.perturb)}
    models = vllm_models(args.configs, args.dtype)
    if args.load_parity:
        out = [load_parity(*model, perturb.get(i)) for i, model in enumerate(models)]
    else:
        out = [named_parameters(*model) for model in models]
    sys.stdout.write("RESHARD_JSON " + json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
