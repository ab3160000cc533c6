"""A running vLLM OpenAI-compatible server seen from the trainer, over HTTP with the standard library only (the
trainer side imports no vLLM). The server needs `VLLM_SERVER_DEV_MODE=1` (the RL routes) and
`--weight-transfer-config '{"backend": "reshard"}'`.

    server = VllmServer("http://127.0.0.1:8000")
    server.wait_healthy(timeout=300)
    server.weight_info()        # the weight version the server reports
"""
from __future__ import annotations

import json
import math
import time
import urllib.parse
from types import SimpleNamespace
from typing import Any

from ..arguments import seconds, text
from ..errors import ArgumentError, ExecutionError
from ..polling import poll
from .engines import EngineClient, Leased, Pausable, ReportsInFlight, ReportsStaged, landing_ended
from .lease_keeper import ROUTE, request, request_body


class VllmServer(EngineClient, Pausable, ReportsInFlight, ReportsStaged, Leased):
    """A running `vllm serve`, driven over HTTP.

    Speaks vLLM's weight-sync client protocol (init / start / update / finish), pause / resume, the driver's lease,
    the weight version, checksums, LoRA adapters and completions.

    Args:
        url: the server's base URL, http(s)://host:port.
        timeout: seconds any request may take.
        api_key: the server's API key, if it has one.

    Raises:
        ArgumentError: a URL that is not http(s)://host:port, or a bad timeout or key.
    """

    def __init__(self, url: str, timeout: float = 600.0, api_key: str | None = None) -> None:
        text("url", url)
        seconds("timeout", timeout)
        text("api_key", api_key, none=True)
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ArgumentError("url", url, "must be http(s)://host:port")
        self.url, self.timeout, self.api_key = url.rstrip("/"), timeout, api_key
        self.lease_holder: str | None = None  # sent with every call once a lease is taken

    def __repr__(self) -> str:
        return f"VllmServer({self.url})"

    def call(self, method: str, route: str, body: dict[str, Any] | None = None, timeout: float | None = None,
             text: bool = False) -> Any:
        """One request; its JSON answer (its text with `text`).

        Raises:
            ExecutionError: a non-2xx answer (with the server's message), or the server unreachable.
        """
        try:
            answer = request(self.url, route, body, method=method, api_key=self.api_key, holder=self.lease_holder,
                             timeout=timeout or self.timeout)
        except ConnectionError as e:
            raise ExecutionError(str(e)) from None
        if text:
            return answer
        return json.loads(answer) if answer else None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.call("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.call("POST", "/start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.call("POST", "/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.call("POST", "/finish_weight_update", {"weight_version": weight_version})

    def acquire_lease(self, holder: str, ttl: float, timeout: float | None = None) -> None:
        """Take (or renew) the server's lease as `holder` for `ttl` seconds; every later call carries it."""
        try:
            self.call("POST", ROUTE, request_body(holder, ttl), timeout=timeout)
        except ExecutionError as e:
            if "HTTP 404" in str(e):
                raise ExecutionError(f"{self.url} has no driver lease: start it with --middleware "
                                     f"reshard.adapters.vllm.lease.ReshardLeaseMiddleware (or pass lease=None to "
                                     f"TrainerSession: then a dead driver leaves the server paused)") from None
            raise
        self.lease_holder = holder

    def lease_endpoint(self) -> dict[str, Any]:
        """Where the driver's keeper process renews the lease."""
        return {"url": self.url, "api_key": self.api_key}

    def release_lease(self, timeout: float | None = None) -> None:
        """End this client's lease (the server closes whatever it left open)."""
        holder, self.lease_holder = self.lease_holder, None
        if holder:
            self.call("POST", ROUTE, request_body(holder, release=True), timeout=timeout)

    def lease_state(self) -> dict[str, Any]:
        """The server's lease: holder, generation, what it holds open."""
        return self.call("GET", ROUTE)

    def pause(self, mode: str = "wait") -> None:
        """Stop generating: "wait" lets requests in flight finish, "abort" aborts them, "keep" freezes them."""
        self.call("POST", "/pause?" + urllib.parse.urlencode({"mode": mode}))

    def resume(self) -> None:
        self.call("POST", "/resume")

    def in_flight(self) -> list[str] | None:
        """The ids of the requests the engine's workers hold now; None without reshard's worker extension."""
        answers = self._if_served(self.collective_rpc, "reshard_in_flight")
        return None if answers is None else sorted({i for ids in answers for i in ids})

    def staged(self) -> bool | None:
        """Whether the open update's staged transfer ended on every worker; None without the worker extension."""
        answers = self._if_served(self.collective_rpc, "reshard_staged")
        return None if answers is None else landing_ended(answers)

    @staticmethod
    def _if_served(fn: Any, *args: Any) -> Any:
        """`fn(*args)`, or None where the server lacks the route (the dev routes, the worker extension)."""
        try:
            return fn(*args)
        except ExecutionError:
            return None

    def weight_info(self) -> str | None:
        """The weight version the server reports."""
        return self.call("GET", "/weight_info")["weight_version"]

    def weight_checksums(self) -> dict[str, str]:
        """vLLM's own checksum of every parameter, by name (all workers)."""
        return self.call("POST", "/weight_checker", {"action": "checksum"})["checksums"]

    def landed(self) -> list[dict[str, Any]]:
        """reshard's digest of what the last refit landed, per worker (needs the worker extension):
        [{"rank", "refit", "installed", "digests": {name: sha256}}]."""
        return self.collective_rpc("reshard_landed")

    def collective_rpc(self, method: str, args: tuple[str, ...] = ()) -> list[Any]:
        """A worker method by name on every worker (the dev route /collective_rpc; string arguments only)."""
        return self.call("POST", "/collective_rpc", {"method": method, "args": list(args)})["results"]

    def world_size(self) -> int:
        """The engine's number of workers."""
        return int(self.call("GET", "/get_world_size")["world_size"])

    def healthy(self) -> bool:
        """Whether /health answers within 5 s."""
        try:
            self.call("GET", "/health", timeout=5.0)
            return True
        except ExecutionError:
            return False

    def wait_healthy(self, timeout: float, alive: Any = None) -> None:
        """Wait until /health answers; `alive()` (e.g. a Popen's poll() is None) stops the wait early."""
        def exited() -> None:
            if alive is not None and not alive():
                raise ExecutionError(f"the server at {self.url} exited before it was healthy")

        if not poll(self.healthy, time.monotonic() + timeout, first_s=1.0, most_s=1.0, between=exited):
            raise ExecutionError(f"the server at {self.url} was not healthy within {timeout:.0f} s")

    def load_lora_adapter(self, name: str, path: str, inplace: bool = False) -> int | None:
        """Serve the PEFT directory `path` as model `name` (`inplace`: reload it from its path). Returns the engine's
        id of a newly served adapter (what an in-slot refit names), or None when that cannot be told."""
        before = None if inplace else self._if_served(self.lora_ids)
        self.call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path, "load_inplace": inplace},
                  text=True)
        after = self._if_served(self.lora_ids) if before is not None else None
        new = after - before if after is not None else set()
        return new.pop() if len(new) == 1 else None

    def lora_ids(self) -> set[int]:
        """The ids of the adapters loaded in every worker of the engine (vLLM's `list_loras`)."""
        per_worker = []
        for answer in self.collective_rpc("list_loras"):
            text = str(answer).strip().removeprefix("set()")  # an empty set: no ids, as "{}" reads
            try:
                per_worker.append({int(x) for x in text.strip("{}[]").split(",") if x.strip()})
            except ValueError:
                raise ExecutionError(f"{self.url}: list_loras answered {text[:200]!r}, not a set of ids") from None
        return set.intersection(*per_worker) if per_worker else set()

    def greedy(self, prompts: list[list[int]], max_tokens: int = 12, model: str | None = None) -> list[list[int]]:
        """The generated token ids of greedy completions of token-id prompts (by the base model, or `model`)."""
        return [[int(t) for t in self._greedy(prompt, model, max_tokens=max_tokens, return_token_ids=True)["token_ids"]]
                for prompt in prompts]

    def _greedy(self, prompt: list[int], model: str | None, **fields: Any) -> dict[str, Any]:
        """The choice of a greedy `/v1/completions` of one token-id prompt."""
        body = {"model": model or self.model(), "prompt": prompt, "temperature": 0.0, **fields}
        return self.call("POST", "/v1/completions", body)["choices"][0]

    def prompt_logprobs(self, prompts: list[list[int]],
                        model: str | None = None) -> list[tuple[list[float], list[int]]]:
        """Per prompt, for every position after the first, the log-probability of the prompt's token there and the
        argmax token (vLLM's rank 1), scored without sampling.

        Raises:
            ExecutionError: the server's answer lacks a position, its token, a rank-1 token or a finite value.
        """
        from ..verify.engines import prompt_rows

        out = []
        for prompt in prompts:
            rows = self._greedy(prompt, model, max_tokens=1, prompt_logprobs=1).get("prompt_logprobs")
            if isinstance(rows, list):  # each row read as vLLM's own {token: Logprob}, checked where the LLM's are
                rows = [{int(k): SimpleNamespace(rank=v.get("rank"), logprob=v.get("logprob", math.nan))
                         for k, v in (row or {}).items() if isinstance(v, dict)} for row in rows]
            out.append(prompt_rows(prompt, rows if isinstance(rows, list) else None, self.url))
        return out

    def model(self) -> str:
        """The served model's name (the first of /v1/models), asked once."""
        if not hasattr(self, "_model"):
            self._model = self.call("GET", "/v1/models")["data"][0]["id"]
        return self._model


class ExtensionClient(EngineClient, Pausable, ReportsStaged):
    """A refit's engine calls through the `reshard` worker extension (a server's `/collective_rpc`, or an in-process
    `vllm.LLM`'s `collective_rpc`) instead of the weight-transfer API, which drops every loaded LoRA adapter at finish:
    what in-slot LoRA refits need. An in-process engine's pause and resume do nothing.

        TrainerSession(refit, rank, tensors, engines=[ExtensionClient(server)])
    """

    def __init__(self, server: "VllmServer | Any") -> None:
        self.server = server

    def __repr__(self) -> str:
        return f"ExtensionClient({getattr(self.server, 'url', 'in-process')})"

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        if isinstance(self.server, VllmServer):
            return self.server.collective_rpc(method, tuple(json.dumps(a) for a in args))
        return self.server.collective_rpc(method, args=args)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._rpc("reshard_init", init_info)

    def start_weight_update(self) -> None:
        self._rpc("reshard_start")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._rpc("reshard_update", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if weight_version is not None:  # None: closing a failed update, which needs no call
            self._rpc("reshard_finish")

    def staged(self) -> bool:
        return landing_ended(self._rpc("reshard_staged"))

    def pause(self, mode: str = "wait") -> None:
        if isinstance(self.server, VllmServer):
            self.server.pause(mode)

    def resume(self) -> None:
        if isinstance(self.server, VllmServer):
            self.server.resume()


__all__ = ["ExtensionClient", "VllmServer"]
