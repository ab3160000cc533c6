"""reshard as a verl checkpoint engine (`checkpoint_engine.backend: reshard`). Imports verl; see __init__.

verl's `CheckpointEngineManager.update_weights` drives it per refit: `prepare()` on every rank (trainer rank 0
hosts the refit's store); `build_topology` on the driver (checks the metadata, compiles one plan per tensor
group: topology); `init_process_group` (every process compiles the same plans, checks their digests, joins and
starts a RefitSession); `send_weights` on every trainer rank and `receive_weights` on every rollout rank, the
transfers on a thread, groups moving in the order the stream completes them once every trainer rank announced
them (integrations.agreement); `finalize()`. Staging "bucket" (default) hands on a group once every process moved
it (memory: two groups); "model", the whole model once every process agreed on all of it. Delta refits
keep an executors.delta.DeltaState per group for the engine's life; a failed refit drops them (the next is a
keyframe). docs/guides/verl.md has what the backend does and what a failed refit leaves.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any, AsyncIterator, Iterable, Sequence

import torch
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry

from ...adapters import rendezvous as rv
from ...addresses import ENV, routable_address
from ...errors import ArgumentError, ExecutionError, ReshardError
from ...executors.binding import Binding
from ...layouts import ModelSpec
from ..agreement import Agreement
from ..groups import (available_bytes, check_room, delta_totals, group_bindings, group_executor, model_spec,
                      receive_groups, resolve_device, send_groups, staging_empty, tensor_bytes, tensor_groups,
                      transfer_thread)
from ..streams import StreamNames
from .modes import BACKEND
from .topology import RefitAssignment, build, check_options, model_digest


@CheckpointEngineRegistry.register(BACKEND)
class ReshardCheckpointEngine(CheckpointEngine):
    """One trainer or rollout rank's end of verl's checkpoint-engine refit (see the module docstring).

    verl constructs it as `CheckpointEngineRegistry.new("reshard", bucket_size=..., is_master=...,
    **engine_kwargs["reshard"])`; rollout ranks pass no `is_master`.

    Args:
        bucket_size: verl's bucket in bytes: the model moves in tensor groups of at most this size.
        is_master: trainer ranks: whether this is rank 0 (None: a rollout rank).
        model: the HF config of the model (a dict, a config.json path or a checkpoint directory).
        dtype: the dtype the trainer streams (default: the config's).
        host: the address trainer rank 0 hosts the store on (None: its Ray node's IP; set it only to choose among
            a multi-homed node's addresses).
        device: where rollout ranks receive (default: cuda when available).
        **options: transport ("collective" | "nixl" | "shared"), fanout, staging ("bucket" | "model"), checksum
            (False | True | "sha256" | "sum64"), timeout (seconds), backend (gloo/nccl), delta (K: a dense
            keyframe every K refits; needs staging "model" and no fanout).

    Raises:
        ArgumentError: a missing model, an unknown option (`atomic` names its replacement; `pause_for` and
            `staging` "device" / "host" say why not), a bad bucket, or "model" staging on a rollout rank whose
            device has less free memory than the model takes.
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
        self.spec = spec = model_spec(model, dtype)
        self.bucket_size, self.host = bucket_size, host
        self.groups = tensor_groups(spec, bucket_size)  # refuses a bad bucket here, on every rank
        self.options = check_options(options)
        self.transport = self.options.get("transport", "collective")
        self.timeout = float(self.options.get("timeout", 300.0))
        self.device = resolve_device(device, "engine_kwargs.reshard.device")
        if self.device.type == "cuda" and self.device.index is None:  # the transfer thread needs it explicit
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.role == "rollout" and self.options.get("staging") == "model":
            staging_room(spec, self.device)
        self.names = StreamNames(spec)
        self.where = {name: k for k, group in enumerate(self.groups) for name in group}
        self.delta = self.options.get("delta")
        self._deltas: dict[int, Any] = {}  # with delta: group -> this process's DeltaState, for the engine's life
        self._held: dict[int, dict[str, torch.Tensor]] = {}  # with delta, a rollout rank: the groups' buffers
        self._refits = 0  # trainer rank 0: refits prepared (the versions of delta refits)
        self._store = self._rdv = None
        self._session: RefitSession | None = None
        self.last_metrics: dict[str, float] = {}

    def prepare(self) -> dict[str, Any]:
        """Report this rank's role, model, bucket and options; trainer rank 0 hosts the refit's store."""
        meta = {"role": self.role, "master": self.is_master, "model_digest": model_digest(self.spec),
                "bucket_size": self.bucket_size, "options": self.options, "node": node_here()}
        if self.is_master:
            self.finalize()
            self._refits += 1
            self._rdv, self._store = rv.host_store(rv.Rendezvous.new(self.host, 0, timeout=self.timeout))
            # where the store's address came from, so a bad one is blamed on what set it (build_topology)
            source = "engine_kwargs.reshard.host" if self.host is not None else (
                ENV if os.environ.get(ENV) else "discovered")
            meta.update(model=self.spec.model_dump(), rendezvous=self._rdv.to_dict(), host_source=source,
                        version=self._refits)
        return meta

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list], dict[str, list]]:
        """Every process's RefitAssignment (topology.build): trainers' and rollouts' `topology` kwargs."""
        trainers, rollouts = build(actor_wg_world_size, rollout_world_size, metadata)
        return {"topology": trainers}, {"topology": rollouts}

    def init_process_group(self, topology: dict[str, Any]) -> None:
        """Compile and check the plans, join the refit's rendezvous (and group) and start its session."""
        top = RefitAssignment.from_dict(topology)
        if top.is_trainer != (self.role == "trainer") or model_digest(top.spec) != model_digest(self.spec):
            raise ArgumentError("topology", f"process {top.process}", f"does not fit this {self.role} rank (another "
                                f"role or model than it was configured with)")
        plans = top.plans()
        rdv = rv.Rendezvous.from_dict(top.rendezvous)
        if not self.is_master:
            self.finalize()
            self._store = rv.connect(rdv)
        self._rdv = rdv
        size = top.trainers + top.rollouts
        rv.join(self._store, rdv, top.process, size, self.role)
        comm = None
        if self.transport == "collective":
            from ...executors.collective.comm import StoreComm

            backend = self.options.get("backend") or ("nccl" if self.device.type == "cuda" else "gloo")
            comm = StoreComm(rv.scoped(self._store, rdv, "collective"), top.process, size, backend, self.timeout)
        policies = None
        if self.delta is not None:
            from ...executors.delta import DeltaPolicy, DeltaState

            policies = {k: DeltaPolicy(self.delta, state=self._deltas.setdefault(k, DeltaState()))
                        for k in range(len(plans))}
        self._session = RefitSession(top, plans, group_bindings(plans, top.trainers, top.rollouts), self._store, rdv,
                                     comm, self.options, self.device if self.device.type == "cuda" else None,
                                     policies)

    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterator,
                           global_steps: int | None = None) -> dict[str, float]:
        """Check the stream and move each group on the transfer thread once all its tensors came (at most one
        moving, one waiting); every rank drains the whole stream, even after a failure (it may run collectives).

        Returns:
            This rank's metrics (egress bytes, seconds).

        Raises:
            ArgumentError: the stream does not fit the plan (a tensor unknown, repeated, missing, misshapen),
                posted to every process of the refit at once.
            ExecutionError: a transfer failed, or another process reported a failure.
        """
        session = self._ready("send_weights", trainer=True)
        filling: dict[int, dict[str, torch.Tensor]] = {}
        position: dict[int, int] = {}  # group -> the position the trainers move it at (completion order)

        def take(hf: str, piece: torch.Tensor, k: int) -> tuple[int, ...]:
            group = filling.setdefault(k, {})
            group[hf] = piece.detach().contiguous()
            if len(group) < len(self.groups[k]):
                return ()
            position[k] = len(position)
            session.agreement.go(position[k], k)
            return (k,)

        def start(k: int) -> Future:  # the transfer thread moves group k once its gate opened
            i, src = position[k], filling.pop(k)
            return session.pool.submit(lambda: session.move(session.agreement.gate(i), src))

        def fail(error: BaseException, flight: Any = None) -> None:  # every process hears of it at once
            session.agreement.fail(error)
            filling.clear()  # nothing more moves: the drain holds no tensors
            self._deltas.clear()  # what the rollout holds is unknown now: the next refit is a keyframe

        began = time.perf_counter()
        try:
            sent, _, error, _ = await send_groups(weights, self.names, self.where, "trainer", session.agreement, take,
                                                  start, fail)
            if error is not None:
                raise error
        except BaseException as e:  # also a cancellation
            fail(e)
            raise
        p = session.top.process
        self.last_metrics = {f"reshard/trainer{p}/egress_bytes": float(sent),
                             f"reshard/trainer{p}/seconds": time.perf_counter() - began,
                             **session.delta_metrics(f"reshard/trainer{p}/")}
        return self.last_metrics

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yield each group (received on the transfer thread while the previous one is handed on) once every
        process moved it ("bucket"; the last also after the trainers' verdict), or the whole model once every
        process agreed on all of it ("model").

        Yields:
            (HF name, tensor) for verl's server adapter, valid until the next group is handed on.

        Raises:
            ExecutionError: the refit failed on any process (in "bucket" staging the groups already handed on
                stay loaded).
        """
        session = self._ready("receive_weights", trainer=False)
        bucket = self.options.get("staging", "bucket") == "bucket"
        if not bucket and not self._held:  # (with delta, held buffers are reused: nothing more to allocate)
            staging_room(self.spec, self.device)  # verl may have taken memory since the construction's check

        def receive(i: int) -> tuple[int, dict[str, torch.Tensor]]:  # the transfer thread: the trainers' i-th group
            k = session.agreement.gate(i)
            dst = self._held.get(k) or {n: staging_empty(*self.names.expected(n), self.device,
                                                         self.transport == "shared") for n in self.groups[k]}
            if self.delta is not None:  # the version a delta is applied to, kept between refits
                self._held[k] = dst
            session.move(k, dst)
            return k, dst

        def fail(error: BaseException, flight: Any, following: int) -> None:
            session.agreement.fail(ExecutionError("the server adapter stopped taking the weights before the refit's "
                                                  "end") if isinstance(error, GeneratorExit) else error)
            self._deltas.clear()  # the next refit is a keyframe (it rewrites every held buffer)

        rank, start = session.top.process - session.top.trainers, time.perf_counter()
        groups = receive_groups(len(self.groups), lambda i: session.pool.submit(receive, i), bucket, self.device,
                                session.agreement, fail, agreed=True)
        try:
            async for k, dst in groups:
                for name in self.groups[k]:
                    yield name, dst[name]
        finally:
            await groups.aclose()
        self.last_metrics = {f"reshard/rollout{rank}/seconds": time.perf_counter() - start,
                             **session.delta_metrics(f"reshard/rollout{rank}/")}

    def finalize(self) -> None:
        """Close this refit's session, its group and (trainer rank 0) the store."""
        if self._session is not None:
            self._session.close()
        self._session = None
        self._store = None  # trainer rank 0's store server goes with its last reference (a session may hold it)

    def _ready(self, what: str, trainer: bool) -> RefitSession:
        if self._session is None:
            raise ExecutionError(f"{what} before init_process_group: verl's CheckpointEngineManager calls prepare, "
                                 f"build_topology and init_process_group first")
        if self._session.top.is_trainer != trainer:
            raise ExecutionError(f"{what} on a {self.role} rank")
        return self._session


class RefitSession:
    """One process's part of one refit, from `init_process_group` to `finalize` or the next `prepare`.

    Args:
        top: this process's assignment.
        plans, bindings: every group's plan and who plays its ranks.
        store, rdv, comm: the refit's store (joined), rendezvous and collective group (None for other transports).
        options: the backend's checked options.
        device: the CUDA device the transfer thread works on (None: CPU).
        policies: with delta, each group's DeltaPolicy (refit `top.version`); None: dense refits.
    """

    def __init__(self, top: RefitAssignment, plans: Sequence[Any], bindings: Sequence[Binding], store: Any,
                 rdv: rv.Rendezvous, comm: Any, options: dict[str, Any], device: torch.device | None,
                 policies: dict[int, Any] | None = None) -> None:
        self.top, self.plans, self.bindings, self.store, self.rdv, self.comm = top, plans, bindings, store, rdv, comm
        self.policies = policies
        self.reports: dict[int, Any] = {}  # with delta: group -> its executor's DeltaReport
        self.options, self.timeout = options, float(options.get("timeout", 300.0))
        role, p = ("trainer", top.process) if top.is_trainer else ("rollout", top.process - top.trainers)
        self.agreement = Agreement(rv.scoped(store, rdv, "verl"), top.trainers + top.rollouts, top.trainers,
                                   len(plans), self.timeout, f"{role} rank {p}")
        self.pool = transfer_thread(device, f"reshard-verl-{role}")

    def move(self, k: int, tensors: dict[str, torch.Tensor]) -> int:
        """Move this process's part of group k (its sources or destinations) on the transfer thread, then count it
        done; the bytes it sent. Raises the transfer's ReshardError (posted as the refit's failure unless a peer's
        came first)."""
        try:
            ex = group_executor(self.options.get("transport", "collective"), self.plans[k], self.bindings[k],
                                self.top.process, tensors, store=self.store, rendezvous=self.rdv,
                                namespace=f"{self.rdv.refit_id}g{k}", comm=self.comm, timeout=self.timeout,
                                checksum=self.options.get("checksum", False), memory_cap=self.top.bucket_size,
                                delta=self.policies and self.policies[k])
            try:
                if self.policies:  # versions say what each side holds: the same on every process
                    stats = ex.refit(self.top.version)
                    self.reports[k] = ex.last_delta
                else:
                    stats = ex.refit()
            finally:
                ex.close()
        except Exception as e:  # noqa: BLE001 - a transport's own error too: name the group, keep the cause
            error = e if isinstance(e, ReshardError) else ExecutionError(f"{type(e).__name__}: {e}")
            reason = self.agreement.failure()  # a peer's failure seen here as a broken transfer: say what it was
            if reason is not None and isinstance(error, ExecutionError):
                error = ExecutionError(f"refit failed in tensor group {k} of {len(self.plans)}: {reason} (here: "
                                       f"{error})")
            raise self.agreement.fail(error) from e
        self.agreement.done(k)
        return sum(stats.bytes_sent.values())

    def delta_metrics(self, prefix: str) -> dict[str, float]:
        """With delta: this refit's keyframe groups and, on a trainer, delta and dense bytes; else nothing."""
        if not self.policies:
            return {}
        totals = delta_totals(self.reports.values())
        names = {"keyframe_groups": "keyframes", **({"delta_bytes": "wire_bytes", "dense_bytes": "dense_bytes"}
                                                     if self.top.is_trainer else {})}
        return {prefix + ours: float(totals[theirs]) for ours, theirs in names.items()}

    def close(self) -> None:
        """End this session's waits and let its thread go; close the collective group in the background (after a
        failure its shutdown waits for posted gloo operations to time out)."""
        self.agreement.stop.set()
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.comm is not None:
            threading.Thread(target=self.comm.close, daemon=True, name="reshard-verl-close").start()
            self.comm = None


def staging_room(spec: ModelSpec, device: torch.device) -> None:
    """Refuse (ArgumentError naming both sizes) "model" staging where the model exceeds `device`'s free memory."""
    need = sum(tensor_bytes(spec, t.name) for t in spec.tensors)
    check_room(need, available_bytes(device), device, "engine_kwargs.reshard.staging", "rollout rank")


def node_here() -> dict[str, str | None]:
    """This rank's host for build_topology's store-address check: its Ray node id and the address other hosts
    reach it at (None where unknown)."""
    node_id = address = None
    ray = sys.modules.get("ray")  # every verl worker has Ray imported and initialized; never import it here
    if ray is not None and ray.is_initialized():
        with contextlib.suppress(Exception):  # an older or partial Ray: the address alone decides
            node_id = ray.get_runtime_context().get_node_id()
    with contextlib.suppress(ReshardError):  # a RESHARD_HOST that is not this host's: the master's prepare reports it
        address = routable_address()
    return {"id": node_id, "address": address}


__all__ = ["BACKEND", "ReshardCheckpointEngine"]
