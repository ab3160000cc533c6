"""Refits where trainer workers and vLLM engines are Ray actors (the NeMo-RL / verl / SkyRL shape).

Engines are `VllmEngineActor`s (a vLLM `LLM` in an actor, possibly in the vLLM virtualenv), driven by a
`TrainerSession` through `RayEngineClient`s. Everything that crosses an actor call is JSON text.

    engine = ray.remote(VllmEngineActor).options(runtime_env={"py_executable": vllm_python}).remote(
        model_dir, json.dumps({"tensor_parallel_size": 1, "dtype": "float32"}))
    # on trainer actor 0:
    session = TrainerSession(refit, 0, tensors, engines=[RayEngineClient(engine, "engine-0")], ...)

Addresses need no configuration: the store binds the Ray node IP (reshard.addresses); RESHARD_HOST or
`TrainerSession(host=...)` overrides it on a multi-homed node. Imports ray and vllm lazily.
"""
from __future__ import annotations

import json
import os
import threading
from typing import Any

from ..errors import ExecutionError
from .engines import EngineClient, Leased, ReportsStaged, landing_ended
from .lease_keeper import request_body


class RayEngineClient(EngineClient, Leased, ReportsStaged):
    """vLLM's weight-sync client protocol over a `VllmEngineActor` handle, each call waiting at most `timeout` s."""

    def __init__(self, actor: Any, name: str, timeout: float = 600.0) -> None:
        self.actor, self.name, self.timeout = actor, name, timeout
        self.lease_holder: str | None = None  # sent with every refit call once a lease is taken

    def __repr__(self) -> str:
        return f"engine {self.name}"

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        import ray

        timeout = timeout or self.timeout
        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise ExecutionError(f"{self}: {method} did not answer within {timeout:.0f} s") from None
        except ray.exceptions.RayActorError as e:
            raise ExecutionError(f"{self} is gone (its actor died): {_first_line(e)}") from None
        except ray.exceptions.RayTaskError as e:
            raise ExecutionError(f"{self}: {method} failed: {_first_line(e.cause if e.cause else e)}") from None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", json.dumps(init_info), self.lease_holder)

    def start_weight_update(self) -> None:
        self._call("start_weight_update", self.lease_holder)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._call("update_weights", json.dumps(update_info), self.lease_holder)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version, self.lease_holder)

    def staged(self) -> bool:
        return landing_ended(json.loads(self._call("staged")))

    def acquire_lease(self, holder: str, ttl: float, timeout: float | None = None) -> None:
        self._call("lease", json.dumps(request_body(holder, ttl)), timeout=timeout)
        self.lease_holder = holder

    def release_lease(self, timeout: float | None = None) -> None:
        holder, self.lease_holder = self.lease_holder, None
        if holder:
            self._call("lease", json.dumps(request_body(holder, release=True)), timeout=timeout)

    def lease_state(self) -> dict[str, Any]:
        """The engine lease: holder, generation, what it holds open (adapters.vllm.lease.LeaseBook.state)."""
        return json.loads(self._call("lease_state"))

    def load_lora(self, name: str, path: str) -> int:
        """Serve the PEFT directory `path` as adapter `name` (enable_lora); its id, what `lora_id` names."""
        return int(self._call("load_lora", name, path))

    def greedy(self, prompts: list[list[int]], max_tokens: int = 12, lora: str | None = None) -> list[list[int]]:
        """Greedy tokens of the base model, or with the adapter loaded as `lora`."""
        return json.loads(self._call("greedy", json.dumps(prompts), max_tokens, lora))

    def prompt_logprobs(self, prompts: list[list[int]]) -> list[tuple[list[float], list[int]]]:
        """Per token-id prompt, each later token's log-probability and the argmax there (a reshard.verify Scorer)."""
        rows = json.loads(self._call("prompt_logprobs", json.dumps([[int(t) for t in p] for p in prompts])))
        if not isinstance(rows, list) or len(rows) != len(prompts):
            raise ExecutionError(f"{self}: prompt_logprobs answered {type(rows).__name__} for {len(prompts)} prompts")
        return [(list(map(float, lp)), list(map(int, am))) for lp, am in rows]

    def weight_version(self) -> str:
        """The weight version the engine serves."""
        return self._call("weight_version")

    def weight_checksums(self) -> dict[str, str]:
        """vLLM's own checksum of every parameter, by name (all workers)."""
        return json.loads(self._call("weight_checksums"))

    def landed(self) -> list[dict[str, Any]]:
        """reshard's end-to-end digest of what the last refit landed, per worker, before vLLM's repacking."""
        return json.loads(self._call("landed"))

    def stats(self) -> list[dict[str, Any]]:
        """Each worker's plan-cache counts (ReshardWorkerExtension.reshard_stats)."""
        return json.loads(self._call("stats"))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__


class VllmEngineActor:
    """A vLLM engine with the `reshard` weight-transfer backend and worker extension, as a Ray actor.

    `engine_args` is JSON of `LLM` keyword arguments; methods take and return JSON text. Create it threaded
    (`.options(max_concurrency=4)`) so that lease renewals get through while an update runs."""

    def __init__(self, model: str, engine_args: str = "{}", env: str = "{}") -> None:
        os.environ.update(json.loads(env))
        from vllm import LLM

        from .server import ExtensionClient
        from .vllm.lease import ThreadedLease
        from .vllm.trainer import OfflineLLMClient

        args = {"enforce_eager": True, "skip_tokenizer_init": True, "enable_prefix_caching": False, "seed": 0,
                "weight_transfer_config": {"backend": "reshard"},
                "worker_extension_cls": "reshard.adapters.vllm.worker.ReshardWorkerExtension",
                **json.loads(engine_args)}
        self.llm = LLM(model=model, **args)
        self.loras: dict[str, Any] = {}  # name -> LoRARequest
        self.api, self.extension = OfflineLLMClient(self.llm), ExtensionClient(self.llm)
        self.client = self.api  # the refit in progress: an adapter's goes through the worker extension
        self.engine_lock = threading.RLock()  # one engine call at a time (the actor may be threaded)
        self.guard = ThreadedLease(lambda: self.client, self.engine_lock)

    def pid(self) -> int:
        """This actor's process id."""
        return os.getpid()

    def node_address(self) -> str:
        """The IP of the Ray node this engine runs on (where its workers' addresses are found)."""
        import ray

        return str(ray.util.get_node_ip_address())

    def lease(self, request: str) -> str:
        """A lease request (adapters.lease_keeper.request_body as JSON); its answer as JSON."""
        return json.dumps(self.guard.request(request.encode()))

    def lease_state(self) -> str:
        """The lease's holder, generation and what it holds open, as JSON."""
        return json.dumps(self.guard.book.state())

    def init_weight_transfer_engine(self, init_info: str, holder: str | None = None) -> None:
        """Bind the engine to a refit (its payload as JSON), as `holder`."""
        info = json.loads(init_info)

        def init() -> None:
            lora_slot = isinstance(info, dict) and info.get("install") == "lora_slot"
            self.client = self.extension if lora_slot else self.api
            self.client.init_weight_transfer_engine(info)

        self.guard.call("/init_weight_transfer_engine", holder, init)

    def start_weight_update(self, holder: str | None = None) -> None:
        """Open an update, as `holder`."""
        self.guard.call("/start_weight_update", holder, lambda: self.client.start_weight_update())

    def update_weights(self, update_info: str, holder: str | None = None) -> None:
        """One phase of the open update (its info as JSON), as `holder`."""
        info = json.loads(update_info)
        self.guard.call("/update_weights", holder, lambda: self.client.update_weights(info), info)

    def finish_weight_update(self, weight_version: str | None, holder: str | None = None) -> None:
        """Close the open update (None: a failed one), as `holder`."""
        self.guard.call("/finish_weight_update", holder, lambda: self.client.finish_weight_update(weight_version),
                        {"version": weight_version})

    def staged(self) -> str:
        """Each worker's answer to `reshard_staged`, as JSON."""
        with self.engine_lock:
            return json.dumps(self.llm.collective_rpc("reshard_staged"))

    def load_lora(self, name: str, path: str) -> int:
        """Serve the PEFT directory `path` as adapter `name` (again: under its id); the id."""
        from vllm.lora.request import LoRARequest

        known = self.loras.get(name)
        request = LoRARequest(name, known.lora_int_id if known else len(self.loras) + 1, path)
        with self.engine_lock:
            added = self.llm.llm_engine.add_lora(request)
        if not added:
            raise RuntimeError(f"vLLM did not load the adapter {name!r} from {path}")
        self.loras[name] = request
        return request.lora_int_id

    def greedy(self, prompts: str, max_tokens: int, lora: str | None = None) -> str:
        """Greedy tokens of the token-id prompts (JSON), by the base model or the adapter `lora`, as JSON."""
        from vllm import SamplingParams

        if lora is not None and lora not in self.loras:
            raise ValueError(f"no adapter {lora!r} loaded (loaded: {sorted(self.loras)})")
        self._serving()
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False)
        with self.engine_lock:
            outs = self.llm.generate([{"prompt_token_ids": p} for p in json.loads(prompts)], params, use_tqdm=False,
                                     lora_request=self.loras.get(lora) if lora else None)
        return json.dumps([list(o.outputs[0].token_ids) for o in outs])

    def prompt_logprobs(self, prompts: str) -> str:
        """JSON [[logprobs, argmax], ...] of the token-id prompts (JSON), scored without sampling."""
        from ..verify.engines import llm_prompt_logprobs

        self._serving()
        with self.engine_lock:
            return json.dumps(llm_prompt_logprobs(self.llm, json.loads(prompts)))

    def _serving(self) -> None:
        """Refuse to generate while a torn flip fences the engine (adapters.vllm.lease.LeaseBook.closed)."""
        with self.guard.lock:
            why = self.guard.book.closed("/generate")
        if why is not None:
            raise ExecutionError(why)

    def weight_version(self) -> str:
        """The weight version the engine serves."""
        with self.engine_lock:
            return self.llm.get_weight_version()

    def weight_checksums(self) -> str:
        """vLLM's checksum of every parameter, all workers merged, as JSON."""
        with self.engine_lock:
            per_worker = self.llm.collective_rpc("compute_weight_checksums")
        return json.dumps({name: digest for worker in per_worker for name, digest in worker.items()})

    def landed(self) -> str:
        """reshard's digest of what the last refit landed on each worker (WorkerSession.landed)."""
        with self.engine_lock:
            return json.dumps(self.llm.collective_rpc("reshard_landed"))

    def stats(self) -> str:
        """Each worker's plan-cache counts, as JSON."""
        with self.engine_lock:
            return json.dumps(self.llm.collective_rpc("reshard_stats"))

    def processes(self) -> list[int]:
        """The PIDs of this engine's own processes (engine core, workers)."""
        import psutil

        return [p.pid for p in psutil.Process().children(recursive=True)]

    def shutdown(self) -> None:
        """Stop the engine's processes (before the actor is killed)."""
        self.llm.llm_engine.engine_core.shutdown()


__all__ = ["RayEngineClient", "VllmEngineActor"]
