"""Refits where trainer workers and vLLM engines are Ray actors (the NeMo-RL / verl / SkyRL shape).

Engines are `VllmEngineActor`s: a vLLM `LLM` in an actor, which may run in the vLLM virtualenv
(`runtime_env={"py_executable": ...}`) while the trainer actors run in a virtualenv without vLLM. The trainer
side is the same `TrainerSession` as for a server; its engines are `RayEngineClient`s, vLLM's weight-sync client
protocol over actor calls. Everything that crosses an actor call is JSON text (Ray's own transport pickles the
call; nothing of reshard's is pickled).

    engine = ray.remote(VllmEngineActor).options(runtime_env={"py_executable": vllm_python}).remote(
        model_dir, json.dumps({"tensor_parallel_size": 1, "dtype": "float32"}))
    # on trainer actor 0:
    session = TrainerSession(refit, 0, tensors, engines=[RayEngineClient(engine, "engine-0")], ...)

This module imports ray and vllm lazily (only inside the calls that need them).
"""
from __future__ import annotations

import json
import os
from typing import Any

from ..errors import ExecutionError


class RayEngineClient:
    """vLLM's weight-sync client protocol (init / start / update / finish, pause / resume) over a
    `VllmEngineActor` handle; every call waits at most `timeout` seconds."""

    def __init__(self, actor: Any, name: str, timeout: float = 600.0) -> None:
        self.actor, self.name, self.timeout = actor, name, timeout

    def __repr__(self) -> str:
        return f"engine {self.name}"

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            raise ExecutionError(f"{self}: {method} did not answer within {self.timeout:.0f} s") from None
        except ray.exceptions.RayActorError as e:
            raise ExecutionError(f"{self} is gone (its actor died): {_first_line(e)}") from None
        except ray.exceptions.RayTaskError as e:
            raise ExecutionError(f"{self}: {method} failed: {_first_line(e.cause if e.cause else e)}") from None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", json.dumps(init_info))

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._call("update_weights", json.dumps(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)

    def pause(self, mode: str = "wait") -> None:
        pass  # an offline engine generates only when asked: nothing is in flight during a refit

    def resume(self) -> None:
        pass

    # --- what a caller checks ----------------------------------------------------------------------
    def greedy(self, prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
        return json.loads(self._call("greedy", json.dumps(prompts), max_tokens))

    def weight_version(self) -> str:
        return self._call("weight_version")

    def weight_checksums(self) -> dict[str, str]:
        return json.loads(self._call("weight_checksums"))

    def stats(self) -> list[dict[str, Any]]:
        return json.loads(self._call("stats"))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__


class VllmEngineActor:
    """A vLLM engine (`vllm.LLM`) with the `reshard` weight-transfer backend, as a Ray actor. `engine_args` is JSON
    of `LLM` keyword arguments (model excluded); the worker extension is added so that `stats` can count plan
    compiles. Methods take and return JSON text."""

    def __init__(self, model: str, engine_args: str = "{}", env: str = "{}") -> None:
        os.environ.update(json.loads(env))
        from vllm import LLM

        args = {"enforce_eager": True, "skip_tokenizer_init": True, "enable_prefix_caching": False, "seed": 0,
                "weight_transfer_config": {"backend": "reshard"},
                "worker_extension_cls": "reshard.adapters.vllm.worker.ReshardWorkerExtension",
                **json.loads(engine_args)}
        self.llm = LLM(model=model, **args)

    def pid(self) -> int:
        return os.getpid()

    def init_weight_transfer_engine(self, init_info: str) -> None:
        self.llm.init_weight_transfer_engine({"init_info": json.loads(init_info)})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: str) -> None:
        self.llm.update_weights({"update_info": json.loads(update_info)})

    def finish_weight_update(self, weight_version: str | None) -> None:
        self.llm.finish_weight_update(weight_version)

    def greedy(self, prompts: str, max_tokens: int) -> str:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in json.loads(prompts)], params, use_tqdm=False)
        return json.dumps([list(o.outputs[0].token_ids) for o in outs])

    def weight_version(self) -> str:
        return self.llm.get_weight_version()

    def weight_checksums(self) -> str:
        merged: dict[str, str] = {}
        for worker in self.llm.collective_rpc("compute_weight_checksums"):
            merged.update(worker)
        return json.dumps(merged)

    def stats(self) -> str:
        return json.dumps(self.llm.collective_rpc("reshard_stats"))

    def processes(self) -> list[int]:
        """The PIDs of this engine's own processes (engine core, workers), for a caller that must end them after
        killing the actor."""
        import psutil

        return [p.pid for p in psutil.Process().children(recursive=True)]

    def shutdown(self) -> None:
        """Stop the engine's processes (before the actor is killed)."""
        self.llm.llm_engine.engine_core.shutdown()


__all__ = ["RayEngineClient", "VllmEngineActor"]
