"""reshard as a verl checkpoint engine (`checkpoint_engine.backend: reshard`). Imports verl; see __init__.

Lifecycle, per refit, as verl's `CheckpointEngineManager.update_weights` drives it:
  1. `prepare()` on every rank: trainer rank 0 (verl's `is_master`) hosts the refit's store (a TCPStore with a
     fresh id and secret); every rank reports its role, model digest, bucket and options.
  2. `build_topology(...)` on the driver: checks the metadata and compiles one plan per tensor group (cached:
     verl rebuilds its group every refit, the plans stay).
  3. `init_process_group(topology=...)`: every process compiles the same plans (cached) and checks their digests,
     joins the rendezvous (the secret keeps strangers out) and, for the collective transport, its group; the
     refit's session (session.py) starts its transfer thread.
  4. `send_weights(stream)` on every trainer rank and `receive_weights()` on every rollout rank, concurrently, on
     verl's actor event loops; the transfers run on each process's transfer thread, so the actors stay responsive:
     - a trainer rank checks every stream item (`streams.StreamNames.split`, then shape, dtype, repeats) and, once
       all tensors of a group came, announces the group and moves it on its thread while the stream goes on.
       Groups move in the order the stream completes them (a transformers state dict puts a layer's
       input_layernorm last, the model's order first). Memory: the group moving, one complete group waiting for
       it, and the groups the stream has begun (with a stream in the model's order: none more);
     - a rollout rank receives group k+1 on its thread while group k is handed to verl's server adapter.
  5. `finalize()`: the session, its group and the store are closed.

Staging (`staging` option), what a rollout rank hands verl's server adapter:
  - "bucket" (default): a group is yielded once every process of the refit finished moving it; the refit's last
    group also waits for every trainer rank's end-of-stream verdict (every tensor came once, nothing unknown).
    Memory: BUCKET_SLOTS (2) groups, each at most the bucket (a tensor larger than the bucket is a group of its
    own), plus the collective transport's wire buffers (within one bucket).
  - "model": the whole model is received on the rollout's device and yielded only after every process agreed on
    every group and the trainers' verdict came: all or nothing. Memory: one copy of the model, checked against the
    device's free memory at construction and again at each refit (refused naming both sizes).

A failed refit (a refused stream, a transfer that failed, a process that died): the process that sees it posts the
reason to the refit's store; every other process raises at its next wait (within milliseconds: no process enters a
group's transfer before every trainer rank has the group whole and checked, so none is left inside a gloo receive
waiting for a rank that stopped; a killed process's sockets close). A rollout rank's `receive_weights` then raises:
  - "model": before its first yield, so the server adapter was handed nothing;
  - "bucket": the groups already yielded stay loaded: the rollout serves some groups of the new version and the
    rest of the old one.
verl's server adapters set verl's version (`set_global_steps`) only after the weights generator is exhausted, so a
raising generator never hands the failed refit's version to the engine: `CheckpointEngineWorker.update_weights`,
then the manager's `update_weights`, raise, and the next complete refit loads a whole version. Upstream (verl 0.9.1,
read, not run: no vLLM here): vLLM's adapter starts the worker's `update_weights_from_ipc` before it iterates the
generator, and verl's `BucketedWeightSender` closes its socket without a last bucket when the generator raises; the
worker's `BucketedWeightReceiver` then waits for one with no timeout (docs/guides/verl.md, Failed refits). sglang's
and TensorRT-LLM's adapters pass the error on and keep what they had loaded.
"""
from __future__ import annotations

import asyncio
import inspect
import os
import sys
import threading
import time
from typing import Any, AsyncIterator, Iterable

import torch
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry

from ...adapters import rendezvous as rv
from ...addresses import ENV, routable_address
from ...errors import ArgumentError, ExecutionError, ReshardError
from ...executors.local import torch_dtype
from ...layouts import ModelSpec
from ..streams import StreamNames
from .session import RefitSession
from ..groups import available_bytes, group_bindings, tensor_bytes, tensor_groups
from .topology import RefitAssignment, build, check_options, model_digest

BACKEND = "reshard"


@CheckpointEngineRegistry.register(BACKEND)
class ReshardCheckpointEngine(CheckpointEngine):
    """verl constructs it as `CheckpointEngineRegistry.new("reshard", bucket_size=..., is_master=...,
    **engine_kwargs["reshard"])`: trainer ranks pass `is_master` (rank 0 True), rollout ranks do not.

    model: the HF config of the model (a dict, a config.json path or a checkpoint directory), the same as the
        trainer's and the rollout's `model.path`.
    dtype: the dtype the trainer streams (default: the config's).
    host: the address trainer rank 0 hosts the refit's store on (None, the default: its Ray node's IP, as verl's
        own backends find theirs; set it only to choose among a multi-homed node's addresses).
    device: where rollout ranks receive (default: cuda when available).
    options: transport ("collective" | "nixl" | "shared"), fanout (relay among rollout ranks), staging ("bucket",
        the default, or "model": module docstring), checksum (False | True | "sha256" | "sum64"), timeout
        (seconds), backend (collective: gloo/nccl).

    Raises:
        ArgumentError: a missing model, an unknown option (`atomic` names its replacement), a bad bucket, or
            "model" staging on a rollout rank whose device has less free memory than the model takes.
    """

    wire_format = "named_tensors"

    def __init__(self, bucket_size: int, is_master: bool | None = None, *, model: Any = None, dtype: str | None = None,
                 host: str | None = None, device: str | None = None, **options: Any) -> None:
        if model is None or model == "":  # verl passes engine_kwargs.reshard only: {} when the options sit elsewhere
            raise ArgumentError("engine_kwargs.reshard.model", model, "is required: the HF config of the model (a "
                                "config.json path or checkpoint directory); verl hands this backend only "
                                "checkpoint_engine.engine_kwargs.reshard, so options placed directly under "
                                "engine_kwargs reach no backend")
        self.role = "rollout" if is_master is None else "trainer"
        self.is_master = bool(is_master)
        spec = model if isinstance(model, ModelSpec) else ModelSpec.from_hf_config(model)
        if dtype is not None:
            spec = ModelSpec(**{**spec.model_dump(), "dtype": dtype})
        self.spec, self.bucket_size, self.host = spec, bucket_size, host
        self.groups = tensor_groups(spec, bucket_size)  # refuses a bad bucket here, on every rank
        self.options = check_options(options)
        self.transport = self.options.get("transport", "collective")
        self.timeout = float(self.options.get("timeout", 300.0))
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:  # the transfer thread needs it explicit
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.role == "rollout" and self.options.get("staging") == "model":
            staging_room(spec, self.device)
        self.names = StreamNames(spec)
        self.where = {name: k for k, group in enumerate(self.groups) for name in group}
        self._store = self._rdv = None
        self._session: RefitSession | None = None
        self.last_metrics: dict[str, float] = {}

    # --- 1. prepare ----------------------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        meta = {"role": self.role, "master": self.is_master, "model_digest": model_digest(self.spec),
                "bucket_size": self.bucket_size, "options": self.options, "node": node_here()}
        if self.is_master:
            self._close()
            self._rdv, self._store = rv.host_store(rv.Rendezvous.new(self.host, 0, timeout=self.timeout))
            # where the store's address came from, so a bad one is blamed on what set it (build_topology)
            source = "engine_kwargs.reshard.host" if self.host is not None else (
                ENV if os.environ.get(ENV) else "discovered")
            meta.update(model=self.spec.model_dump(), rendezvous=self._rdv.to_dict(), host_source=source)
        return meta

    # --- 2. build_topology (driver) ------------------------------------------------------------------
    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list], dict[str, list]]:
        trainers, rollouts = build(actor_wg_world_size, rollout_world_size, metadata)
        return {"topology": trainers}, {"topology": rollouts}

    # --- 3. init_process_group -----------------------------------------------------------------------
    def init_process_group(self, topology: dict[str, Any]) -> None:
        top = RefitAssignment.from_dict(topology)
        if top.is_trainer != (self.role == "trainer") or model_digest(top.spec) != model_digest(self.spec):
            raise ArgumentError("topology", f"process {top.process}", f"does not fit this {self.role} rank (another "
                                f"role or model than it was configured with)")
        plans = top.plans()
        rdv = rv.Rendezvous.from_dict(top.rendezvous)
        if not self.is_master:
            self._close()
            self._store = rv.connect(rdv)
        self._rdv = rdv
        size = top.trainers + top.rollouts
        rv.join(self._store, rdv, top.process, size, self.role)
        comm = None
        if self.transport == "collective":
            from ...executors.comm import StoreComm

            backend = self.options.get("backend") or ("nccl" if self.device.type == "cuda" else "gloo")
            comm = StoreComm(rv.scoped(self._store, rdv, "collective"), top.process, size, backend, self.timeout)
        self._session = RefitSession(top, plans, group_bindings(plans, top.trainers, top.rollouts), self.groups,
                                     self._store, rdv, comm, self.options,
                                     self.device if self.device.type == "cuda" else None)

    # --- 4. send / receive ---------------------------------------------------------------------------
    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterator,
                           global_steps: int | None = None) -> dict[str, float]:
        """Check the stream and move each group as soon as its tensors all came (on the transfer thread, while
        the stream goes on): at most one group moving and one complete group waiting for it, besides the groups
        the stream has begun. Every rank drains the whole stream, even after a failure (verl's exporters run
        collectives over the trainer ranks while they produce it).

        Returns:
            This rank's metrics (egress bytes, seconds).

        Raises:
            ArgumentError: the stream does not fit the plan (a tensor unknown, repeated, missing, of another shape
                or dtype), posted to every process of the refit at once.
            ExecutionError: a transfer failed, or another process reported a failure.
        """
        session = self._ready("send_weights", trainer=True)
        try:
            return await self._send(session, weights)
        except BaseException as e:  # the exporter's own error too: every process hears of it at once
            session.fail(e)
            raise

    async def _send(self, session: RefitSession, weights: Any) -> dict[str, float]:
        filling: dict[int, dict[str, torch.Tensor]] = {}
        seen: set[str] = set()
        moving = None  # the transfer in flight (an awaitable of the transfer thread's job)
        position, sent, error, start = 0, 0, None, time.perf_counter()
        async for name, tensor in _items(weights):
            if error is not None:
                continue  # drain: producing the stream is collective over the trainer ranks
            try:
                for hf, piece in self.names.split(name, tensor):
                    self._check(hf, piece, seen, name)
                    k = self.where[hf]
                    group = filling.setdefault(k, {})
                    group[hf] = piece.detach().contiguous()
                    if len(group) < len(self.groups[k]):
                        continue
                    session.post_go(position, k)
                    if moving is not None:  # memory: one group moving, this one waiting for it
                        sent += await moving
                    moving = session.submit(_move_next, session, position, filling.pop(k))
                    position += 1
            except ReshardError as e:
                error = session.fail(e)
                filling.clear()  # nothing more moves: the drain holds no tensors
        if error is None and position < len(self.groups):
            missing = [n for g in self.groups for n in g if n not in seen]
            error = session.fail(ArgumentError("weights", missing[:5], f"({len(missing)} tensors of the model) "
                                               f"never came in the stream",
                                               fix="the trainer must stream every tensor of the model"))
        if moving is not None:
            try:
                sent += await moving  # a transfer begun is finished: its peers are inside it
            except ReshardError as e:
                error = error or e
        if error is not None:
            raise error
        session.post_end()
        seconds = time.perf_counter() - start
        self.last_metrics = {f"reshard/trainer{session.top.process}/egress_bytes": float(sent),
                             f"reshard/trainer{session.top.process}/seconds": seconds}
        return self.last_metrics

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Receive each group on the transfer thread while the previous one is handed on, and yield a group's
        tensors once every process finished moving it ("bucket"; the last group also waits for the trainers'
        end-of-stream verdict) or the whole model once every process agreed on the whole refit ("model").

        Yields:
            (HF name, tensor) for verl's server adapter; each tensor is valid until the next group is handed on.

        Raises:
            ExecutionError: the refit failed on any process (before the first yield in "model" staging; in
                "bucket" staging the groups already handed on stay loaded).
        """
        session = self._ready("receive_weights", trainer=False)
        bucket = self.options.get("staging", "bucket") == "bucket"
        if not bucket:
            staging_room(self.spec, self.device)  # verl may have taken memory since the construction's check
        loop, landed = asyncio.get_running_loop(), asyncio.Queue()
        # buffers: one group being handed on while the next is received (bucket); every group (model)
        slots = threading.Semaphore(BUCKET_SLOTS if bucket else len(self.groups))
        receiving = session.submit(self._receive_all, session, slots, loop, landed)
        receiving.add_done_callback(lambda f: f.cancelled() or f.exception())  # its errors come through `landed`
        rank, start, done = session.top.process - session.top.trainers, time.perf_counter(), False
        try:
            held = []
            for i in range(len(self.groups)):
                item = await landed.get()
                if isinstance(item, BaseException):
                    raise item
                k, dst = item
                if not bucket:
                    held.append((k, dst))
                    continue
                await session.agreed(k)
                if i == len(self.groups) - 1:
                    await session.ended()
                for name in self.groups[k]:
                    yield name, dst[name]
                _synchronize(self.device)  # the adapter's copies out of this group are done before its reuse
                slots.release()
            if not bucket:
                for k, _ in held:
                    await session.agreed(k)
                await session.ended()
                for k, dst in held:
                    for name in self.groups[k]:
                        yield name, dst[name]
            done = True
        except GeneratorExit:
            session.fail(ExecutionError("the server adapter stopped taking the weights before the refit's end"))
            raise
        except BaseException as e:
            session.fail(e)
            raise
        finally:
            if not done:  # the transfer thread takes part in the groups already open, then stops at the next gate
                session.stop.set()
                slots.release(len(self.groups))
        self.last_metrics = {f"reshard/rollout{rank}/seconds": time.perf_counter() - start}

    def _receive_all(self, session: RefitSession, slots: threading.Semaphore, loop: asyncio.AbstractEventLoop,
                     landed: asyncio.Queue) -> None:
        """The rollout's transfer thread: every group in the trainers' order, each into fresh buffers once a slot
        is free; what landed (or the error) goes to the event loop's queue."""
        try:
            for i in range(len(self.groups)):
                k = session.wait_gate(i)
                slots.acquire()  # an open gate is entered: the event loop releases every slot if it stops early
                dst = {name: self._empty(name) for name in self.groups[k]}
                session.move(k, dst=dst)
                loop.call_soon_threadsafe(landed.put_nowait, (k, dst))
        except BaseException as e:  # noqa: BLE001 - handed to the event loop, which raises it
            loop.call_soon_threadsafe(landed.put_nowait, e)

    # --- 5. finalize ---------------------------------------------------------------------------------
    def finalize(self) -> None:
        self._close()

    # --- internals -----------------------------------------------------------------------------------
    def _ready(self, what: str, trainer: bool) -> RefitSession:
        if self._session is None:
            raise ExecutionError(f"{what} before init_process_group: verl's CheckpointEngineManager calls prepare, "
                                 f"build_topology and init_process_group first")
        if self._session.top.is_trainer != trainer:
            raise ExecutionError(f"{what} on a {self.role} rank")
        return self._session

    def _check(self, name: str, tensor: Any, seen: set[str], item: str) -> None:
        """Raise ArgumentError unless `tensor` is the plan's `name` (one of the model's names, from
        StreamNames.split of the stream's `item`) coming for the first time, of its shape and dtype."""
        if name in seen:
            raise ArgumentError("weights", name, "came twice in the stream" + (f" (again in {item})" if item != name
                                                                              else ""))
        seen.add(name)
        want = self.spec.tensor(name)
        dtype = torch_dtype(want.dtype or self.spec.dtype)
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(want.shape) or tensor.dtype != dtype:
            got = (tuple(tensor.shape), tensor.dtype) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ArgumentError(f"weights[{name}]", got, f"does not match the plan's {tuple(want.shape)} {dtype}")

    def _empty(self, name: str) -> torch.Tensor:
        t = self.spec.tensor(name)
        dtype = torch_dtype(t.dtype or self.spec.dtype)
        if self.transport == "shared" and self.device.type == "cpu":
            from ...executors.shared import shared_empty

            return shared_empty(tuple(t.shape), dtype)
        return torch.empty(t.shape, dtype=dtype, device=self.device)

    def _close(self) -> None:
        if self._session is not None:
            self._session.close()
        self._session = None
        self._store = None  # trainer rank 0's store server goes with its last reference (a session may hold it)


BUCKET_SLOTS = 2  # "bucket" staging: groups a rollout rank holds (one handed on, the next received)


def _move_next(session: RefitSession, position: int, src: dict[str, torch.Tensor]) -> int:
    """A trainer's transfer-thread job: move its group `position` once every trainer rank completed it (its gate
    open), or raise if the gate closed."""
    return session.move(session.wait_gate(position), src=src)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def model_bytes(spec: ModelSpec) -> int:
    """Bytes of every tensor of the model, each in its own dtype."""
    return sum(tensor_bytes(spec, t.name) for t in spec.tensors)


def staging_room(spec: ModelSpec, device: torch.device) -> None:
    """Refuse "model" staging where the whole model does not fit in the receiving device's free memory.

    Raises:
        ArgumentError: naming the model's bytes, the free bytes and the fix.
    """
    need, free = model_bytes(spec), available_bytes(device)
    if free is not None and need > free:
        raise ArgumentError("engine_kwargs.reshard.staging", "model",
                            f"stages the whole model on every rollout rank: {need / 2**30:.2f} GiB ({need} bytes), "
                            f"but {device} has {free / 2**30:.2f} GiB ({free} bytes) free",
                            fix="staging: bucket (the default) holds two tensor groups of at most the bucket size "
                                "each; a failed refit then leaves some groups of the new version loaded")


def node_here() -> dict[str, str | None]:
    """Which host this rank runs on, for build_topology's check of the store address: the Ray node id (every
    verl worker is a Ray actor; host names can repeat across nodes, network namespaces share one) and the address
    other hosts reach it at (None where it cannot be told)."""
    node_id = None
    ray = sys.modules.get("ray")  # every verl worker has Ray imported and initialized; never import it here
    if ray is not None and ray.is_initialized():
        try:
            node_id = ray.get_runtime_context().get_node_id()
        except Exception:  # noqa: BLE001 - an older or partial Ray: the address alone decides
            node_id = None
    try:
        address = routable_address()
    except ReshardError:  # a RESHARD_HOST that is not this host's: the master's prepare reports it, not this
        address = None
    return {"id": node_id, "address": address}


async def _items(weights: Any) -> AsyncIterator[tuple[str, torch.Tensor]]:
    if inspect.isasyncgen(weights) or hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


__all__ = ["BACKEND", "ReshardCheckpointEngine"]
