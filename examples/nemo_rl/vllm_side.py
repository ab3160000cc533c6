"""The generation side of examples/nemo_rl/refit.py, run in the vLLM virtualenv: what NeMo-RL's vLLM generation
worker and its worker extension do with a checkpoint engine (NeMo-RL is not installed here; the names follow
nemo_rl/models/generation/vllm/checkpoint_engine.py -- VllmCheckpointEngineMixin, VllmCheckpointEngineRpcMixin --
at the commit in tests/data/nemo_rl_checkpoint_engine.json).

- `CheckpointEngineExtension` is the vLLM worker extension (`worker_extension_cls`): it builds the engine from
  `refit_transport`'s class path inside every vLLM worker, prepares it, joins it as rollout rank `rank_prefix +
  torch.distributed rank`, and loads the batches `receive_weight_batches()` yields into the model.
- `GenerationActor` is the Ray actor holding the vLLM engine: NeMo-RL's `checkpoint_engine_rpc` is a
  `collective_rpc` to every worker of the engine.

One difference from NeMo-RL, for the vLLM CPU build: NeMo-RL (on GPUs) hands each batch to `load_weights`; the CPU
backend repacks weights after loading, so here the batches are loaded inside vLLM's layerwise reload (begun when the
first batch arrives -- a refit that fails before any batch was agreed on yields none, so the model is never touched
-- and finished after the last), which runs that post-processing, as vLLM's own reload does. With the engine's
default "bucket" staging a refit that fails later has yielded the batches before the failure (the model then mixes
two versions until the next refit succeeds: the engine's docstring says which); with "model" staging it yields
none.
"""
from __future__ import annotations

import asyncio
import importlib
import json
import os
from typing import Any


def create_checkpoint_engine(backend: str, bucket_size_bytes: int, engine_kwargs: dict[str, Any]) -> Any:
    """NeMo-RL's factory for a `module:Class` refit_transport: import, then construct with the bucket size."""
    module, name = backend.split(":", 1)
    return getattr(importlib.import_module(module), name)(bucket_size=bucket_size_bytes, **engine_kwargs)


class CheckpointEngineExtension:
    """Mixed into vLLM's worker class (`self` is the worker: model_runner, vllm_config)."""

    def init_checkpoint_engine(self, backend: str, bucket_size_bytes: int, engine_kwargs: dict[str, Any]) -> None:
        if getattr(self, "checkpoint_engine", None) is None:
            self.checkpoint_engine = create_checkpoint_engine(backend, bucket_size_bytes, engine_kwargs)

    def prepare_checkpoint_engine(self) -> Any:
        import torch.distributed as dist

        metadata = self.checkpoint_engine.prepare()
        return {**metadata, "rank": dist.get_rank()} if isinstance(metadata, dict) else metadata

    def init_checkpoint_engine_process_group(self, rank_prefix: int, train_world_size: int, rollout_world_size: int,
                                             metadata: list[Any]) -> None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.get_world_size() == rollout_world_size else rank_prefix + dist.get_rank()
        self.checkpoint_engine.init_rollout_process_group(rollout_rank=rank, train_world_size=train_world_size,
                                                          rollout_world_size=rollout_world_size, metadata=metadata)

    def update_weights_from_checkpoint_engine(self) -> bool:
        return asyncio.run(self._update_weights())

    async def _update_weights(self) -> bool:
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        model = self.model_runner.get_model()
        reloading = False
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            try:
                async for batch in self.checkpoint_engine.receive_weight_batches():
                    if not reloading:
                        initialize_layerwise_reload(model)
                        reloading = True
                    model.load_weights(weights=batch)
                    own_pending_weights(model, batch)
            finally:
                if reloading:
                    finalize_layerwise_reload(model, self.vllm_config.model_config)
        return True

    def finalize_checkpoint_engine(self) -> None:
        engine = getattr(self, "checkpoint_engine", None)
        if engine is not None:
            engine.finalize()


def own_pending_weights(model: Any, batch: list) -> None:
    """vLLM's layerwise reload keeps the tensors handed to a layer until all of that layer's weights came
    (reload/layerwise.py: `loaded_weights`), but the engine's batches are views of buckets it reuses for the batch
    after next (as NeMo-RL's NIXL engine's are): copy those still held before the next batch is asked for, as
    NeMo-RL's own layerwise path does (modelopt/models/generation/vllm_quant_backend.py,
    `_detach_pending_layerwise_weights`). `load_weights` without the layerwise reload keeps nothing."""
    import torch
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    buckets = {t.untyped_storage().data_ptr() for _, t in batch}
    for module in model.modules():
        info = LAYERWISE_INFO.get(module)
        for _, arguments in (info.loaded_weights if info is not None else ()):
            for key, value in arguments.arguments.items():
                if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in buckets:
                    arguments.arguments[key] = value.clone()


class GenerationActor:
    """A vLLM engine in a Ray actor, driven the way NeMo-RL's synchronous vLLM generation worker is."""

    def __init__(self, model: str, tp: int, env: dict[str, str]) -> None:
        os.environ.update(env)
        from vllm import LLM

        self.llm = LLM(model=model, tensor_parallel_size=tp, dtype="float32", max_model_len=128, enforce_eager=True,
                       skip_tokenizer_init=True, enable_prefix_caching=False, seed=0,
                       worker_extension_cls="vllm_side.CheckpointEngineExtension")

    def checkpoint_engine_rpc(self, checkpoint_method: str, method_args: tuple = ()) -> Any:
        result = self.llm.collective_rpc(checkpoint_method, args=tuple(method_args))
        if checkpoint_method == "update_weights_from_checkpoint_engine":
            return all(item for item in result if item is not None)
        return result

    def greedy(self, prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def prompt_logprobs(self, prompts: list[list[int]]) -> list[tuple[list[float], list[int]]]:
        """The engine's log-probability of each prompt token after the first, and its argmax there (plain lists):
        the engine side of reshard.verify's train-inference mismatch check."""
        from reshard.verify import llm_prompt_logprobs

        return llm_prompt_logprobs(self.llm, prompts)

    def weight_checksums(self) -> str:
        """vLLM's own checksum of every parameter (every worker's, merged), as JSON."""
        merged: dict[str, str] = {}
        for worker in self.llm.collective_rpc("compute_weight_checksums"):
            merged.update(worker)
        return json.dumps(merged, sort_keys=True)

    def processes(self) -> list[int]:
        import psutil

        return [p.pid for p in psutil.Process().children(recursive=True)]

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
