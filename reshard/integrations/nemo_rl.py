"""reshard as a NeMo-RL checkpoint engine: the non-colocated refit transport NeMo-RL selects by class path.

    policy:
      generation:
        backend: vllm
        colocated: {enabled: false}
        refit_transport: "reshard.integrations.nemo_rl:ReshardCheckpointEngine"
        refit_cfg:
          "reshard.integrations.nemo_rl:ReshardCheckpointEngine":
            model: /path/to/the/hf/checkpoint        # or its config.json: what vLLM serves

NeMo-RL's interface (nemo_rl/utils/checkpoint_engines/base.py at the commit in
tests/data/nemo_rl_checkpoint_engine.json) is duck-typed: nothing of NeMo-RL is imported. All workers meet at
policy worker 0's store and move the model in groups of at most `bucket_size` bytes (integrations.groups); a batch
reaches vLLM only once every process agreed on it (integrations.agreement), and a refused refit fails every
process within about a second. docs/guides/nemo_rl.md has how a refit moves and what a failure leaves.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import json
import time
from collections.abc import AsyncGenerator, Generator
from typing import Any

import torch

from ..addresses import check_local
from ..arguments import integer
from ..errors import ArgumentError, ExecutionError, ReshardError
from .agreement import Agreement
from ..executors.partition import carve
from ..limits import MAX_RANKS
from .groups import (available_bytes, check_options, check_room, delta_totals, group_bindings, group_executor,
                     group_plans, model_spec, receive_groups, refuse, refuse_moved_experts, refuse_serving,
                     refuse_unknown, resolve_device, send_groups, staging_empty, synchronize, tensor_bytes,
                     tensor_groups, transfer_thread)
from .streams import StreamNames

TRANSPORTS = ("collective", "shared")
ALIGN = 256  # bytes: every tensor in a bucket starts aligned for any dtype and vectorised copies
# where NeMo-RL holds vLLM's generation for a whole refit (commit 7ea279a; docs/guides/nemo_rl.md has the rest)
SERVING_WHY = ("NeMo-RL hands the engine the weights only inside one vLLM collective_rpc, "
               "update_weights_from_checkpoint_engine, issued together with the policy workers' send "
               "(nemo_rl/weight_sync/checkpoint_engine_weight_synchronizer.py:225-231), and vLLM's engine core runs no "
               "step until every worker returned it: in-flight requests survive the refit "
               "(grpo.async_grpo.in_flight_weight_updates) but make no progress during it")


class ReshardCheckpointEngine:
    """One policy or vLLM worker's end of NeMo-RL's checkpoint-engine refit (see the module docstring).

    NeMo-RL constructs it with `bucket_size` and the `refit_cfg` entry as keyword arguments. Memory on a vLLM
    worker: two buckets ("bucket" staging) or the whole model ("model", refused at join when larger than the free
    memory measured at construction); on a policy worker, two buckets of its share of a group plus the tensors of
    later groups the stream delivers early.

    Args:
        bucket_size: bytes per batch handed to vLLM's loaders; the model moves in groups of this size.
        model: the HF checkpoint directory, config.json or config dict of the model vLLM serves.
        staging: "bucket" (default: each batch handed on once every process agreed on it) or "model" (all or
            nothing: nothing handed on until every process agreed on the whole model).
        transport: "collective" (torch.distributed at policy worker 0's store: gloo on CPU, NCCL on GPUs) or
            "shared" (one host: shared memory on CPU, CUDA IPC on GPUs).
        host: this worker's own address for its store (None: discovered per worker).
        fanout: vLLM workers relaying to at most this many others (collective only; None: no relays).
        checksum: True (sha256), "sum64" or False (None: sha256 on CPU, sum64 on GPUs).
        backend: the collective transport's torch.distributed backend (None: NCCL on CUDA, else gloo).
        device: where the workers stage the weights (None: CUDA when available, else CPU).
        dtype: the dtype the policy sends and vLLM loads (None: the checkpoint config's).
        timeout: seconds any wait may go without progress.
        release_after_refit: NeMo-RL's key (its synchronizer then calls finalize after every refit).
        delta: delta refits with a dense keyframe every this many versions (None: every refit dense); needs
            staging "model", no fanout, no release_after_refit and, with the shared transport, CPU tensors.
        **unknown: any other key of the refit_cfg entry: refused, naming it.

    Raises:
        ArgumentError: a bad option, refit while serving (`pause_for`, `staging` "device" / "host") or `delta`
            without what it needs (at construction); "model" staging larger than the free memory (at join); from
            `send_weights`, the tensor of this worker's stream that is wrong.
        ExecutionError: from the refit methods, a peer or transfer that failed or another worker's refusal.
    """

    shard_expert_weights: bool = False  # NeMo-RL's expert-sharding loader stays off: the plan says who sends what

    def __init__(self, bucket_size: int, *, model: str | dict[str, Any] | None = None, staging: str = "bucket",
                 transport: str = "collective", host: str | None = None, fanout: int | None = None,
                 checksum: bool | str | None = None, backend: str | None = None, device: str | None = None,
                 dtype: str | None = None, timeout: float = 300.0, release_after_refit: bool = False,
                 delta: int | None = None, **unknown: Any) -> None:
        refuse_serving({**unknown, "staging": staging}, "refit_cfg ", SERVING_WHY, "nemo_rl")
        # NeMo-RL passes every key of the refit_cfg entry (its schema allows extra keys): a typo lands in `unknown`
        refuse_unknown(unknown, [p for p in inspect.signature(type(self)).parameters if p not in ("bucket_size",
                       "unknown")], "refit_cfg", "ReshardCheckpointEngine (NeMo-RL passes every key of its refit_cfg "
                       "entry to the constructor)")
        if model is None:
            raise ArgumentError("model", None, "is required", fix="add `model: <the HF checkpoint vLLM serves>` to "
                                "refit_cfg's entry for this engine")
        self.device = resolve_device(device)
        if checksum is None:  # sha256 on the host, sum64 where the bytes are on a GPU (computed there)
            checksum = "sum64" if self.device.type == "cuda" else True
        check_options({"staging": staging, "transport": transport, "fanout": fanout, "timeout": timeout,
                       "delta": delta, "checksum": checksum}, transports=TRANSPORTS)
        if delta is not None and release_after_refit:
            raise ArgumentError("delta", delta, "with release_after_refit: NeMo-RL then finalizes after every "
                                "refit, which drops the version the vLLM workers hold (every refit a keyframe)",
                                fix="unset release_after_refit, or delta")
        if delta is not None and transport == "shared" and self.device.type == "cuda":
            raise ArgumentError("delta", delta, "with the shared transport on CUDA: delta refits over shared "
                                "memory run on CPU tensors", fix="transport: collective (NCCL carries them)")
        self.backend = _backend(transport, backend, fanout, self.device)
        self.bucket_size, self.staging, self.transport = bucket_size, staging, transport
        self.fanout, self.checksum, self.delta = fanout, checksum, delta
        self.spec = model_spec(model, dtype)
        if host is not None:  # every engine hosts a store at prepare(): an address of another node fails here, at once
            check_local(host, "refit_cfg host", "; NeMo-RL gives every policy and vLLM worker the same refit_cfg "
                        "entry, so an address of one node is wrong on all others", fix="remove `host`: each worker "
                        "finds its own address; RESHARD_HOST in a node's environment chooses among a multi-homed "
                        "node's addresses")
        self.host, self.timeout = host, float(timeout)
        self.release_after_refit = bool(release_after_refit)
        self.groups = tensor_groups(self.spec, bucket_size)  # refuses a bad bucket_size
        self._names = StreamNames(self.spec)
        self._where = {name: k for k, group in enumerate(self.groups) for name in group}
        # measured here: NeMo-RL builds a vLLM worker's engine after vLLM reserved its memory; refused at join
        self.model_bytes = self._arena([t.name for t in self.spec.tensors])[1]
        self.free_bytes = available_bytes(self.device) if staging == "model" else None
        self._reset()

    def _reset(self) -> None:
        self.role: str | None = None  # "policy" or "rollout" once a process group is joined
        self.rank = -1
        self.store: Any = None
        self.offer: Any = None  # the rendezvous this engine hosts after prepare()
        self.last_refit: dict[str, Any] = {}  # what the last refit did here (bytes, seconds, batches, memory)
        self._rdv: Any = None
        self._plans: list = []
        self._bindings: tuple = ()
        self._executors: list = []
        self._comm: Any = None
        self._slots: list[torch.Tensor] = []  # this worker's buckets (bytes)
        self._views: list[dict[str, torch.Tensor]] = []  # per group: this worker's tensors its executor is bound to
        self._needed: list[frozenset[str]] = []  # policy, per group: the tensors the plan reads from this worker
        self._held = 0  # bytes of buffers this worker keeps between refits
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._refits = 0  # refits since joining (each agrees under keys of its own)
        self._agreement: Agreement | None = None  # the refit's, once it began
        self._moved_at: dict[int, float] = {}  # this refit's groups: time.time() each was agreed here
        self._deltas: dict[int, Any] = {}  # this refit's groups: each executor's DeltaReport (with `delta`)
        self._version = 0  # refits since the executors were built (at join, or at refit _refits - _version + 1)
        self._broken = False

    def prepare(self) -> dict[str, Any]:
        """Host a rendezvous store (only policy worker 0's is used) and say what this engine was built for."""
        from ..adapters import rendezvous as rv

        self.offer, self.store = rv.host_store(rv.Rendezvous.new(self.host, timeout=min(self.timeout, 300.0)))
        return {"reshard": self._settings(), "rendezvous": self.offer.to_dict()}

    def _settings(self) -> dict[str, Any]:
        """Plain JSON values (they are compared after travelling through Ray or vLLM's RPC)."""
        return json.loads(json.dumps({"model": self.spec.model_dump(), "bucket_size": self.bucket_size,
                                      "staging": self.staging, "transport": self.transport, "fanout": self.fanout,
                                      "checksum": self.checksum, "backend": self.backend,
                                      "device": self.device.type, "delta": self.delta}))

    def init_policy_process_group(self, *, worker_rank: int, train_world_size: int, rollout_world_size: int,
                                  metadata: list[Any]) -> None:
        """Policy worker `worker_rank` joins: process `worker_rank` of every group's plan binding."""
        self._join("policy", worker_rank, train_world_size, rollout_world_size, metadata)

    def init_rollout_process_group(self, *, rollout_rank: int, train_world_size: int, rollout_world_size: int,
                                   metadata: list[Any]) -> None:
        """vLLM worker `rollout_rank` joins as process train_world_size + `rollout_rank`; with staging "model",
        refuses (ArgumentError, every worker told at once) a model larger than the free memory."""
        self._join("rollout", rollout_rank, train_world_size, rollout_world_size, metadata)

    def _join(self, role: str, rank: int, train_world_size: int, rollout_world_size: int,
              metadata: list[Any]) -> None:
        from ..adapters import rendezvous as rv

        T = integer("train_world_size", train_world_size, 1, MAX_RANKS)
        R = integer("rollout_world_size", rollout_world_size, 1, MAX_RANKS)
        integer("worker_rank" if role == "policy" else "rollout_rank", rank, 0, (T if role == "policy" else R) - 1)
        if self.offer is None:
            raise ExecutionError("init_*_process_group before prepare(): NeMo-RL prepares every engine first")
        rdv = rv.Rendezvous.from_dict(self._check_metadata(metadata, T + R))
        if role == "policy" and rank == 0:
            if rdv.refit_id != self.offer.refit_id:
                raise ArgumentError("metadata", "entry 0", "must be policy worker 0's own prepare() result (NeMo-RL "
                                    "lists policy workers first, sorted by rank)")
        else:  # only policy worker 0's store is used
            self.store = rv.connect(rdv)
        if role == "rollout" and self.staging == "model":
            try:
                check_room(self.model_bytes, self.free_bytes, self.device, "staging", "vLLM worker")
            except ArgumentError as error:
                rv.fail(self.store, rdv, f"rollout worker {rank}: {error}")  # the others stop waiting in join at once
                raise
        self._close()
        self._plans = group_plans(self.spec, T, R, self.groups, self.fanout)  # the same on every worker
        self._bindings = group_bindings(self._plans, T, R)
        process = rank if role == "policy" else T + rank
        rv.join(self.store, rdv, process, T + R, role)
        self.role, self.rank, self._rdv, self._process, self._T, self._R = role, rank, rdv, process, T, R
        try:
            self._build()
        except BaseException:
            self._close()
            self.role, self.rank = None, -1
            raise

    def _check_metadata(self, metadata: Any, n: int) -> dict[str, Any]:
        """Check every engine's prepare() result (policy workers' first); returns policy worker 0's rendezvous."""
        if not isinstance(metadata, list) or len(metadata) != n:
            got = f"{len(metadata)} entries" if isinstance(metadata, list) else type(metadata).__name__
            raise ArgumentError("metadata", got, f"must list one prepare() result per worker ({n}: policy workers "
                                                 f"first)")
        ours = self._settings()
        differ = [k for k, m in enumerate(metadata) if not isinstance(m, dict) or m.get("reshard") != ours
                  or not isinstance(m.get("rendezvous"), dict)]
        if differ:
            raise ArgumentError("metadata", f"entries {differ[:10]}",
                                "come from engines built with other settings (model, bucket_size, staging, "
                                "transport, fanout, checksum, backend, device, delta) or from another checkpoint "
                                "engine",
                                fix="give every worker the same refit_cfg entry")
        return metadata[0]["rendezvous"]

    def _build(self) -> None:
        """This worker's buffers and one executor per group (every process builds them together: at join, and at
        the first refit after a failed one)."""
        from ..adapters import rendezvous as rv
        from ..executors.collective.comm import StoreComm

        g, P = self._refits, self._process  # a build's namespaces: the refits before it (one build per refit)
        device = torch.device("cuda", torch.cuda.current_device()) if self.device.type == "cuda" else self.device
        self._device = device
        if self._pool is None:  # one thread per join: the current CUDA device is known once the worker joined
            self._pool = transfer_thread(device, f"reshard-{self.role}{self.rank}")
        if self.transport == "collective":
            self._comm = StoreComm(rv.scoped(self.store, self._rdv, f"collective{g}"), P, self._T + self._R,
                                   self.backend, self.timeout)
        self._views = self._rollout_buffers(device) if self.role == "rollout" else self._policy_buffers(device)
        self._executors = []
        policy = None
        if self.delta is not None:
            from ..executors.delta import DeltaPolicy

            policy = DeltaPolicy(keyframe_every=self.delta)
        for k, (plan, binding) in enumerate(zip(self._plans, self._bindings)):
            self._executors.append(group_executor(
                self.transport, plan, binding, P, self._views[k], store=self.store, rendezvous=self._rdv,
                namespace=f"{self._rdv.refit_id}g{g}k{k}", comm=self._comm, timeout=self.timeout,
                checksum=self.checksum, memory_cap=self.bucket_size, delta=policy))
        self._version, self._broken = 0, False

    def _rollout_buffers(self, device: torch.device) -> list[dict[str, torch.Tensor]]:
        """Views of this vLLM worker's buckets per group: two reused in turn ("bucket") or one per group ("model");
        in shared memory on CPU with the shared transport."""
        count = 2 if self.staging == "bucket" else len(self.groups)
        sizes = [self._arena(group)[1] for group in self.groups]
        self._slots = [staging_empty((max(sizes[i::count]),), torch.uint8, device, self.transport == "shared")
                       for i in range(min(count, len(sizes)))]
        self._held = sum(s.numel() for s in self._slots)
        return [self._carve(self._slots[k % count], group) for k, group in enumerate(self.groups)]

    def _policy_buffers(self, device: torch.device) -> list[dict[str, torch.Tensor]]:
        """Views of this policy worker's two buckets per group: the tensors the plan reads from it, and never-read
        stand-ins for the group's other tensors (the executor wants every tensor its source table lists)."""
        P = self._process
        self._needed = [frozenset(plan.src_tensors.name(int(t)) for t in set(
            plan.ops_sent_by(binding.src_ranks_of(P)[0])["src_tensor"].tolist()))
            for plan, binding in zip(self._plans, self._bindings)]
        mine = [[n for n in group if n in need] for group, need in zip(self.groups, self._needed)]
        sizes = [self._arena(names)[1] for names in mine]
        slots = [torch.empty(max(sizes[i::2]), dtype=torch.uint8, device=device) for i in range(min(2, len(sizes)))]
        spare = max((tensor_bytes(self.spec, n) for k, group in enumerate(self.groups) for n in group
                     if n not in self._needed[k]), default=1)
        largest = max(slots, key=lambda t: t.numel())
        # stand-ins are never read and sources may share memory: a bucket serves unless the largest is too small
        scratch = largest if largest.numel() >= spare else torch.empty(spare, dtype=torch.uint8, device=device)
        self._slots = slots
        self._held = sum(s.numel() for s in slots) + (0 if scratch is largest else scratch.numel())
        views = [self._carve(slots[k % 2], names) for k, names in enumerate(mine)]
        for view, group in zip(views, self.groups):  # the stand-ins, all at the scratch's start
            others = [n for n in group if n not in view]
            view.update(self._carve(scratch, others, [0] * len(others)))
        return views

    def _arena(self, names: list[str] | tuple[str, ...]) -> tuple[list[int], int]:
        """Byte offsets of `names` laid out in one bucket, each ALIGN-aligned, and the bucket's size."""
        return carve([tensor_bytes(self.spec, n) for n in names], ALIGN)

    def _carve(self, buffer: torch.Tensor, names: list[str] | tuple[str, ...],
               starts: list[int] | None = None) -> dict[str, torch.Tensor]:
        """Views of `buffer`, one per tensor of `names`, at `starts` (None: where `_arena` places them)."""
        out = {}
        for name, start in zip(names, self._arena(names)[0] if starts is None else starts):
            shape, dtype = self._names.expected(name)
            out[name] = buffer[start:start + tensor_bytes(self.spec, name)].view(dtype).view(shape)
        return out

    def get_target_weight_layout(self) -> dict[str, Any] | None:
        """None: NeMo-RL then streams everything unfiltered (its filter is quadratic in the tensors; dropping a
        tensor here is one set lookup)."""
        return None

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None]) -> None:
        """Drain and check `weights` (it may run collectives), moving each group as soon as the stream delivered it.

        Raises:
            ArgumentError: this worker's stream is wrong (a tensor unknown, repeated, missing or misshapen), after
                it is drained; every other process fails at once.
            ExecutionError: the refit failed elsewhere or in the transport.
        """
        if self.role != "policy":
            raise ExecutionError("send_weights on an engine that is not a joined policy worker "
                                 "(call init_policy_process_group first)")
        version, G = self._begin(), len(self.groups)
        missing = [len(group) for group in self.groups]  # per group: tensors the stream has not delivered yet
        early: dict[int, dict[str, torch.Tensor]] = {}  # groups ahead: copies until their turn
        early_bytes = peak = due = 0  # bytes of early copies now and at most; the next group to move

        def take(hf: str, t: torch.Tensor, k: int) -> list[int]:  # keep what the plans read from this worker
            nonlocal due, early_bytes, peak
            missing[k] -= 1
            if hf in self._needed[k]:
                if k == due:  # its bucket is free: the group in flight uses the other one
                    self._views[k][hf].copy_(t)
                else:  # a copy: an exporter may reuse what it yields
                    early.setdefault(k, {})[hf] = t.detach().clone()
                    early_bytes += t.nbytes
                    peak = max(peak, early_bytes)
            ready = []
            while due < G and missing[due] == 0:  # groups in model order
                ready.append(due)
                due += 1
            return ready

        def start(k: int) -> concurrent.futures.Future:
            nonlocal early_bytes
            synchronize(self._device)  # this thread's copies into the bucket are done before a peer reads it
            flight = self._pool.submit(self._move, k, version)
            for hf, t in early.pop(k + 1, {}).items():  # its bucket's last group (k - 1) landed
                self._views[k + 1][hf].copy_(t)
                early_bytes -= t.nbytes
            return flight

        def fail(error: BaseException, flight: concurrent.futures.Future | None) -> concurrent.futures.Future:
            early.clear()
            return self._fail(version, error, flight, due)

        start_s = time.perf_counter()
        sent, overlapped, error, refusal = await send_groups(weights, self._names, self._where, "policy",
                                                             self._agreement, take, start, fail)
        if error is None:
            try:
                await self._agreement.ended()
            except ReshardError as e:
                error, refusal = e, self._fail(version, e, None, G)
        if refusal is not None:
            await asyncio.wrap_future(refusal)
        self.last_refit = {"bytes_sent": sent, "seconds": time.perf_counter() - start_s,
                           "kept": sum(len(x) for x in self._needed), "held_bytes": self._held,
                           "early_bytes_peak": peak, "groups": G, "failed": error is not None,
                           "drained_while_moving": overlapped, "delta": self._delta_summary()}
        if error is not None:
            raise self._explained(error)

    async def receive_weight_batches(self) -> AsyncGenerator[list[tuple[str, torch.Tensor]], None]:
        """Batches of whole HF tensors, one group each, in model order, each once every process agreed on it
        ("bucket") or all once every process agreed on the whole model ("model"). The tensors are views of this
        worker's buckets: load them before asking for the next batch.

        Raises:
            LayoutMismatchError: this engine's EPLB moved experts (`groups.refuse_moved_experts`), before any byte
                lands; every other process fails at once.
            ExecutionError: the refit failed here or elsewhere (what vLLM then holds: the module docstring).
        """
        if self.role != "rollout":
            raise ExecutionError("receive_weight_batches on an engine that is not a joined vLLM worker "
                                 "(call init_rollout_process_group first)")
        v = self._begin()
        try:  # read at every refit: EPLB may rebalance between two
            refuse_moved_experts(f"vLLM worker {self.rank}")
        except ReshardError as e:
            await asyncio.wrap_future(self._fail(v, e, None, 0))
            raise
        start, G, bucket = time.perf_counter(), len(self.groups), self.staging == "bucket"
        received, yielded, agreed, self._moved_at = 0, 0, False, {}

        def fail(error: BaseException, flight: concurrent.futures.Future | None, following: int
                 ) -> concurrent.futures.Future:
            # a loader's error stays in the caller's frame: the generator is closed (or cancelled) at the yield
            cause = error if not isinstance(error, (GeneratorExit, asyncio.CancelledError)) else ExecutionError(
                f"stopped taking batches after {yielded} of {G} were handed to its loader (the loader raised, "
                f"or the refit was abandoned)")
            return self._fail(v, cause, flight, following)

        batches = receive_groups(G, lambda i: self._pool.submit(lambda: (i, self._move(i, v))), bucket,
                                 self._device, self._agreement, fail)
        try:
            async for k, nbytes in batches:
                received += nbytes
                if not agreed and (not bucket or k == G - 1):  # every process agreed on the whole model
                    agreed = True
                    self._release_names()
                yielded += 1
                yield [(name, self._views[k][name]) for name in self.groups[k]]
        except ReshardError as e:
            raise self._explained(e) from e
        finally:
            await batches.aclose()
            self.last_refit = {"bytes_received": received, "seconds": time.perf_counter() - start,
                               "batches_yielded": yielded, "groups": G, "held_bytes": self._held,
                               "failed": not agreed, "landed_at": [self._moved_at[k] for k in sorted(self._moved_at)],
                               "delta": self._delta_summary()}

    def _delta_summary(self) -> dict[str, Any] | None:
        """With `delta`: this refit's keyframe groups and (a policy worker) delta against dense bytes."""
        return None if self.delta is None else delta_totals(self._deltas.values())

    def _begin(self) -> int:
        """Start the next refit (its agreement; refit n-2's keys deleted), rebuilding the transport after a failed
        one; returns the executors' version."""
        from ..adapters import rendezvous as rv

        if self._broken:
            self._close_transport()
            self._build()
        self._refits += 1
        self._version += 1
        self._deltas = {}

        def agreement(n: int) -> Agreement:
            return Agreement(rv.scoped(self.store, self._rdv, f"refit{n}"), self._T + self._R, self._T, 0,
                             self.timeout, f"{self.role} worker {self.rank}")

        if self._refits > 2:
            agreement(self._refits - 2).forget()
        self._agreement = agreement(self._refits)
        return self._version

    def _move(self, k: int, v: int) -> int:
        """Move group k of refit version v (on the pool's thread); the bytes this process sent or received."""
        ex = self._executors[k]
        try:
            stats = ex.refit(v)
        finally:
            if self.transport == "collective":
                ex.release()  # its wire buffers: one group's at a time, not every group's
        self._moved_at[k] = time.time()  # (when group k was agreed here: the pipelining test reads it)
        if self.delta is not None:
            self._deltas[k] = ex.last_delta
        return sum((stats.bytes_sent if self.role == "policy" else stats.bytes_received).values())

    def _fail(self, v: int, error: BaseException, flight: concurrent.futures.Future | None,
              next_k: int) -> concurrent.futures.Future:
        """Post the failure's reason and, once the group in flight is done (unless it failed everywhere), fail
        group `next_k` so nobody waits for this worker until its timeout; returns the future of that."""
        self._broken = True
        self._agreement.fail(error)
        reason = f"{self._agreement.who}: {type(error).__name__}: {error}"

        def refuse_next() -> None:  # the pool's one thread: the group in flight has finished by now
            failed = flight is not None and flight.exception() is not None
            if not failed and next_k < len(self._executors):
                refuse(self._executors[next_k], self._process, v, reason)

        return self._pool.submit(refuse_next)

    def _explained(self, error: BaseException) -> BaseException:
        """The error to raise: this worker's own refusal as it is; a failure seen here, with the first reason."""
        if isinstance(error, ArgumentError):
            return error
        first = self._agreement.failure()
        state = "nothing was yielded to vLLM" if self.staging == "model" else (
            "staging bucket: vLLM loaded only the batches yielded before the failure")
        why = f"{first}; here: {error}" if first and first not in str(error) else str(error)
        return ExecutionError(f"reshard refit {self._refits} failed on {self.role} worker {self.rank} ({state}): "
                              f"{why}")

    def finalize(self) -> None:
        """Close the transport and the store; prepare() starts the next meeting."""
        self._close()
        self._reset()

    def _release_names(self) -> None:
        """Unlink this worker's shared-memory buckets once every peer mapped them (nothing left in /dev/shm)."""
        from ..executors.shared import release_shared

        for slot in self._slots:
            if self.transport == "shared" and slot.device.type == "cpu":
                release_shared(slot)

    def _close_transport(self) -> None:
        for ex in self._executors:
            with contextlib.suppress(Exception):  # closing a broken executor is best effort
                ex.close()
        self._release_names()
        self._executors, self._views, self._slots = [], [], []
        if self._comm is not None:
            self._comm.close()
        self._comm = None

    def _close(self) -> None:
        self._close_transport()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._pool = None


def _backend(transport: str, backend: str | None, fanout: int | None, device: torch.device) -> str | None:
    """The collective transport's torch.distributed backend; refuses collective-only options elsewhere."""
    if transport == "shared":
        if fanout is not None:
            raise ArgumentError("fanout", fanout, "is the collective transport's: on one host (shared) every vLLM "
                                "worker is written by the policy workers directly", fix="remove fanout")
        if backend is not None:
            raise ArgumentError("backend", backend, "is the collective transport's (torch.distributed); the "
                                "shared transport has none", fix="remove backend")
        return None
    want = "nccl" if device.type == "cuda" else "gloo"
    if backend not in (None, want):
        raise ArgumentError("backend", backend, f"does not move tensors on {device.type}; the collective transport "
                            f"there runs over {want!r}", fix="leave backend unset")
    return want


__all__ = ["ReshardCheckpointEngine"]
