"""reshard as a verl checkpoint engine (`checkpoint_engine.backend: reshard`). Imports verl; see __init__.

Lifecycle, per refit, as verl's `CheckpointEngineManager.update_weights` drives it:
  1. `prepare()` on every rank: trainer rank 0 (verl's `is_master`) hosts the refit's store (a TCPStore with a
     fresh id and secret); every rank reports its role, model digest, bucket and options.
  2. `build_topology(...)` on the driver: checks the metadata and compiles one plan per tensor group (cached:
     verl rebuilds its group every refit, the plans stay).
  3. `init_process_group(topology=...)`: every process compiles the same plans (cached) and checks their digests,
     joins the rendezvous (the secret keeps strangers out) and, for the collective transport, its group.
  4. `send_weights(stream)` on every trainer rank and `receive_weights()` on every rollout rank, concurrently:
     each group of tensors moves as soon as the stream has delivered it (trainer memory: one group, bounded by
     the bucket); each trainer rank sends only the share the plan gives it. A rollout rank hands its tensors to
     verl's server adapter only after every group arrived and every process agreed (`atomic`, the default: a
     failure anywhere leaves the served weights as they were; memory: one copy of the model on the rollout
     side); `atomic=False` yields each group as it lands (memory: one group; a failure can leave a partial load).
  5. `finalize()`: the group and the store are closed.
A stream that does not match the model (an unknown, repeated or missing tensor, a wrong shape or dtype) fails the
refit: the trainer rank that sees it raises an ArgumentError naming the tensor and posts it to the store; every
other process raises an ExecutionError carrying it (a process blocked in a gloo receive when its wait times out),
before any rollout rank hands anything on.
"""
from __future__ import annotations

import inspect
import os
import sys
import time
from typing import Any, AsyncIterator, Iterable

import torch
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry

from ...adapters import rendezvous as rv
from ...addresses import ENV, routable_address
from ...errors import ArgumentError, ExecutionError, ReshardError
from ...executors.binding import Binding
from ...executors.local import torch_dtype
from ...layouts import ModelSpec
from .topology import DEPTH, RefitAssignment, bindings, build, check_options, model_digest, tensor_groups

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
    options: transport ("collective" | "nixl" | "shared"), fanout (relay among rollout ranks), atomic (default
        True), checksum (False | True | "sha256" | "sum64"), timeout (seconds), backend (collective: gloo/nccl).
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
        self._store = self._rdv = self._comm = self._top = None
        self._plans: list = []
        self._bindings: tuple[Binding, ...] = ()
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
        self._plans = top.plans()
        self._bindings = bindings(self._plans, top.trainers, top.rollouts)
        rdv = rv.Rendezvous.from_dict(top.rendezvous)
        if not self.is_master:
            self._close()
            self._store = rv.connect(rdv)
        self._rdv, self._top = rdv, top
        size = top.trainers + top.rollouts
        rv.join(self._store, rdv, top.process, size, self.role)
        if self.transport == "collective":
            from ...executors.comm import StoreComm

            backend = self.options.get("backend") or ("nccl" if self.device.type == "cuda" else "gloo")
            self._comm = StoreComm(rv.scoped(self._store, rdv, "collective"), top.process, size, backend,
                                   self.timeout)

    # --- 4. send / receive ---------------------------------------------------------------------------
    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterator,
                           global_steps: int | None = None) -> dict[str, float]:
        top = self._ready("send_weights", trainer=True)
        where = {name: k for k, group in enumerate(self.groups) for name in group}
        pending: dict[int, dict[str, torch.Tensor]] = {}
        seen: set[str] = set()
        done, sent, error, start = 0, 0, None, time.perf_counter()
        async for name, tensor in _items(weights):
            if error is not None:
                continue  # drain: producing the stream is collective over the trainer ranks
            error = self._check(name, tensor, where, seen)
            if error is None:
                pending.setdefault(where[name], {})[name] = tensor.detach().contiguous()
                while done < len(self.groups) and len(pending.get(done, ())) == len(self.groups[done]):
                    try:
                        sent += self._run(done, src=pending.pop(done))
                    except ReshardError as e:
                        error = e
                        break
                    done += 1
            if error is not None:
                self._fail(error)
        if error is None and done < len(self.groups):
            missing = [n for g in self.groups[done:] for n in g if n not in seen]
            error = ArgumentError("weights", missing[:5], f"({len(missing)} tensors of the model) never came in the "
                                  f"stream", fix="the trainer must stream every tensor of the model")
            self._fail(error)
        if error is not None:
            raise error
        seconds = time.perf_counter() - start
        self.last_metrics = {f"reshard/trainer{top.process}/egress_bytes": float(sent),
                             f"reshard/trainer{top.process}/seconds": seconds}
        return self.last_metrics

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        top = self._ready("receive_weights", trainer=False)
        rank = top.process - top.trainers
        atomic = self.options.get("atomic", True)
        landed: list[dict[str, torch.Tensor]] = []
        start = time.perf_counter()
        for k, group in enumerate(self.groups):
            dst = {name: self._empty(name) for name in group}
            try:
                self._run(k, dst=dst)
            except ReshardError as e:
                self._fail(e)
                raise
            if atomic:
                landed.append(dst)
            else:
                for name in group:
                    yield name, dst[name]
        self.last_metrics = {f"reshard/rollout{rank}/seconds": time.perf_counter() - start}
        for dst in landed:  # every process agreed on the last group, so on every group: hand them on
            for name, tensor in dst.items():
                yield name, tensor

    # --- 5. finalize ---------------------------------------------------------------------------------
    def finalize(self) -> None:
        self._close()

    # --- internals -----------------------------------------------------------------------------------
    def _ready(self, what: str, trainer: bool) -> RefitAssignment:
        if self._top is None:
            raise ExecutionError(f"{what} before init_process_group: verl's CheckpointEngineManager calls prepare, "
                                 f"build_topology and init_process_group first")
        if self._top.is_trainer != trainer:
            raise ExecutionError(f"{what} on a {self.role} rank")
        return self._top

    def _check(self, name: Any, tensor: Any, where: dict[str, int], seen: set[str]) -> ArgumentError | None:
        if not isinstance(name, str) or name not in where:
            return ArgumentError("weights", name, f"is not a tensor of the {self.spec.family} model the plan was "
                                 f"compiled for", fix="stream the model's HF names")
        if name in seen:
            return ArgumentError("weights", name, "came twice in the stream")
        seen.add(name)
        want = self.spec.tensor(name)
        dtype = torch_dtype(want.dtype or self.spec.dtype)
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(want.shape) or tensor.dtype != dtype:
            got = (tuple(tensor.shape), tensor.dtype) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            return ArgumentError(f"weights[{name}]", got, f"does not match the plan's {tuple(want.shape)} {dtype}")
        return None

    def _empty(self, name: str) -> torch.Tensor:
        t = self.spec.tensor(name)
        dtype = torch_dtype(t.dtype or self.spec.dtype)
        if self.transport == "shared" and self.device.type == "cpu":
            from ...executors.shared import shared_empty

            return shared_empty(tuple(t.shape), dtype)
        return torch.empty(t.shape, dtype=dtype, device=self.device)

    def _run(self, k: int, src: dict | None = None, dst: dict | None = None) -> int:
        """Move group k (this process's part); returns the bytes this process sent to others."""
        from ...executors.base import make_executor

        top, plan = self._top, self._plans[k]
        binding = self._bindings[k]
        src = {binding.src_ranks_of(top.process)[0]: src} if src is not None else {}
        dst = {binding.dst_ranks_of(top.process)[0]: dst} if dst is not None else {}
        checksum = self.options.get("checksum", False)
        try:
            if self.transport == "collective":
                ex = make_executor("distributed", plan, binding, top.process, src, dst, group=self._comm,
                                   in_place=True, memory_cap=self.bucket_size, depth=DEPTH, timeout=self.timeout,
                                   checksum=checksum)
            else:
                store = rv.scoped(self._store, self._rdv, f"{self.transport}{k}")
                namespace = f"{self._rdv.refit_id}g{k}"
                if self.transport == "nixl":
                    from ...executors.nixl import NixlOptions

                    ex = make_executor("nixl", plan, binding, top.process, src, dst, store=store, namespace=namespace,
                                       options=NixlOptions(staged=False, timeout=self.timeout, checksum=checksum))
                else:
                    ex = make_executor("shared", plan, binding, top.process, src, dst, store=store,
                                       namespace=namespace, staged=False, timeout=self.timeout, checksum=checksum)
            try:
                stats = ex.refit()
            finally:
                ex.close()
        except ReshardError as e:
            raise self._explained(e, k) from e
        except Exception as e:  # noqa: BLE001 - a transport's own error: name the group, keep the cause
            raise self._explained(ExecutionError(f"{type(e).__name__}: {e}"), k) from e
        return sum(stats.bytes_sent.values())

    def _explained(self, e: ReshardError, k: int) -> ReshardError:
        """A peer's failure seen here as a broken transfer: say what the failing process reported."""
        reason = None
        try:
            reason = rv.failure(self._store, self._rdv)
        except Exception:  # noqa: BLE001 - the store's host may be gone too
            pass
        if reason is None or isinstance(e, ArgumentError):
            return e
        return ExecutionError(f"refit failed in tensor group {k} of {len(self.groups)}: {reason} (here: {e})")

    def _fail(self, error: BaseException) -> None:
        """Tell every process of the refit why it fails, and break the group so nobody waits for the timeout."""
        if self._store is not None and self._rdv is not None:
            rv.fail(self._store, self._rdv, f"{self.role} process {self._top.process}: {error}")
        if self._comm is not None:
            self._comm.close()
            self._comm = None

    def _close(self) -> None:
        if self._comm is not None:
            self._comm.close()
        self._comm, self._top = None, None
        self._store = None  # trainer rank 0's store server goes with its last reference


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
