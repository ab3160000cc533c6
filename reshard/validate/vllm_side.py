"""The vLLM side of `reshard validate`: `job`, run by reshard.testing.world.run_world in a vLLM virtualenv, one
process per TP rank, gives an entry per HF config (one world checks several: start-up is most of a check's time),
by the check it names:

  named_parameters (vllm layout stage; TP=1)
      each parameter's name and shape.
  load_parity
      models built without an engine (gloo, CPU) from random HF weights by vLLM's load_weights, then by reshard's
      direct and loader installs: the parameters whose bytes differ.
  mismatch_run (the vLLM CPU virtualenv)
      the mismatch stage: an in-process `vllm.LLM` started on random weights T scores a few sequences; reshard
      refits it (HF -> vLLM, loader install, in-process) with other weights, then with T again; reshard.verify's
      float32 check must flag the first and pass the second against the fresh scores. transformers' scores of T are
      reported beside them. The engine runs without vLLM's plain rotary custom op (`ENGINE_CUSTOM_OPS`): the CPU
      build's kernel (0.32) rotates only the first `tokens` rows of MLA's 3-D query (docs/guides/verify.md).

`perturb` (config index -> canonical tensor) corrupts that tensor on reshard's side.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

SEED = 11
SEEDS = (21, 22)  # the engine's starting weights, the refit's
# Eager mode's custom ops ("all"), less the CPU rotary kernel that mis-rotates MLA's 3-D query (module docstring).
ENGINE_CUSTOM_OPS = ["all", "-rotary_embedding"]


def vllm_models(config_paths: list[str], rank: int, world: int,
                dtype: str = "bfloat16") -> Iterator[tuple[Any, Callable[[], Any], int]]:
    """Per config in turn: (its vLLM config, a builder of this rank's model, this rank), the config current while
    it is used. vLLM's distributed state over the gloo world already started is set up at the first config, its
    groups anew at each."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.config import set_current_vllm_config
    from vllm.distributed import destroy_model_parallel, init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

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
                    init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo")
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

    from ..adapters.vllm import LoaderInstaller, bind_direct
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
    plan = compile_plan(source, HfLayout(model=spec, replicas=cfg.parallel_config.world_size))
    installer = LoaderInstaller(model, rank, plan, cfg)
    ReferenceExecutor(plan, None, 0, src, {rank: installer.buffers}).refit()
    installer.load()
    differ += [f"{name} (loader install)" for name in differing()]
    return {"rank": rank, "layout": str(layout), "params": len(want), "differ": differ,
            "bytes": sum(p.numel() * p.element_size() for p in want.values())}


def random_checkpoint(config: dict[str, Any], out: Path, seed: int) -> dict[str, Any]:
    """Write an HF checkpoint of `config` at `out`, every tensor N(0, 1) (a misplaced element moves the
    log-probabilities), and return its tensors."""
    import torch
    from safetensors.torch import save_file

    from ..layouts import ModelSpec

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
    spec = ModelSpec.from_hf_config(str(out))
    gen = torch.Generator().manual_seed(seed)
    weights = {t.name: torch.randn(t.shape, generator=gen, dtype=torch.float32) for t in spec.tensors}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return weights


def mismatch_run(config_path: str, perturb: str | None = None, count: int = 3, length: int = 16) -> dict[str, Any]:
    """The stage's run (module docstring): the reports `before` (other weights), `after` (trained weights again)
    and `transformers`, as dicts."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: the inprocess transport
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm import LLM
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from ..adapters.refit import RefitSpec
    from ..adapters.vllm.trainer import OfflineLLMClient, ReshardTrainerInitInfo
    from ..executors import shard
    from ..layouts import HfLayout, ModelSpec, VllmLayout
    from ..verify import LLMScorer, checkpoint_scores, compare, engine_scores, random_sequences
    from .hf_parity import perturbed

    config = json.loads(Path(config_path).read_text())  # validate.mismatch_config's
    with tempfile.TemporaryDirectory(prefix="reshard_mismatch_") as tmp:
        other_dir, trained_dir = Path(tmp, "other"), Path(tmp, "trained")
        other = random_checkpoint(config, other_dir, SEEDS[0])
        trained = random_checkpoint(config, trained_dir, SEEDS[1])
        spec = ModelSpec.from_hf_config(str(trained_dir))
        sequences = random_sequences(spec.vocab_size, count, length)
        hf = checkpoint_scores(trained_dir, sequences)  # transformers: independent of vLLM and of reshard
        # MLA: the reference CPU backend (vLLM 0.32's AMX one, picked on AMX CPUs, refuses float32 weights)
        mla = {"attention_backend": "CPU_MLA"} if "kv_lora_rank" in config else {}
        llm = LLM(model=str(trained_dir), dtype="float32", enforce_eager=True, max_model_len=128,
                  skip_tokenizer_init=True, enable_prefix_caching=False, seed=0, **mla,
                  compilation_config={"custom_ops": ENGINE_CUSTOM_OPS},
                  weight_transfer_config={"backend": "reshard"},
                  worker_extension_cls="reshard.adapters.vllm.worker.ReshardWorkerExtension")
        scorer = LLMScorer(llm)
        fresh = engine_scores(scorer, sequences)  # vLLM's own loader on the trained weights
        source = HfLayout(model=spec)
        refit = RefitSpec.of(spec, source, VllmLayout(model=spec, tp=1), install="loader", transport="inprocess",
                             options={"key": "validate-mismatch"})
        tensors = shard(source, other)
        trainer = WeightTransferTrainerFactory.trainer_init(ReshardTrainerInitInfo(refit=refit.to_dict(), rank=0),
                                                            client=OfflineLLMClient(llm), source=tensors)
        try:
            trainer.send_weights(version="other")
            before = compare(fresh, engine_scores(scorer, sequences), "float32")
            want = shard(source, perturbed(trained, perturb) if perturb else trained)
            for rank, named in tensors.items():  # the trainer's tensors change in place, as after a step
                for name, tensor in named.items():
                    tensor.copy_(want[rank][name])
            trainer.send_weights(version="trained")
        finally:
            trainer.shutdown()
        engine = engine_scores(scorer, sequences)
    return {"before": before.to_dict(), "after": compare(fresh, engine, "float32").to_dict(),
            "transformers": compare(hf, engine, "float32").to_dict(), "sequences": count, "length": length}


def job(rank: int, world: int, args: dict[str, Any]) -> list[Any]:
    """run_world's entry (module docstring): `args["check"]` of each of `args["configs"]` on this rank.

    Returns:
        One entry per config.
    """
    perturb = {int(i): name for i, name in args["perturb"].items()}
    if args["check"] == "mismatch_run":
        return [mismatch_run(c, perturb.get(i)) for i, c in enumerate(args["configs"])]
    models = vllm_models(args["configs"], rank, world, args["dtype"])
    if args["check"] == "load_parity":
        return [load_parity(*model, perturb.get(i)) for i, model in enumerate(models)]
    return [named_parameters(*model) for model in models]
