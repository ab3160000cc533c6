"""reshard as a NeMo-RL checkpoint engine: the non-colocated refit transport NeMo-RL selects by class path.

    policy:
      generation:
        backend: vllm
        colocated: {enabled: false}
        refit_transport: "reshard.integrations.nemo_rl:ReshardCheckpointEngine"
        refit_cfg:
          "reshard.integrations.nemo_rl:ReshardCheckpointEngine":
            model: /path/to/the/hf/checkpoint        # or its config.json: what vLLM serves

No address in the config: NeMo-RL gives every worker on every node the same entry, so each engine finds its own
(reshard.addresses: RESHARD_HOST in the node's environment, else the Ray node IP, else the default route's
interface) and only policy worker 0's store, at the address it published, is used.

NeMo-RL's interface (nemo_rl/utils/checkpoint_engines/base.py at the commit in
tests/data/nemo_rl_checkpoint_engine.json) is duck-typed here: nothing of NeMo-RL is imported. NeMo-RL builds one
engine per policy worker and per vLLM worker (`create_checkpoint_engine`: `bucket_size` in bytes plus the
`refit_cfg` entry as keyword arguments) and drives them (CheckpointEngineWeightSynchronizer):

  1. `prepare()` on every engine: each hosts a rendezvous store and returns it as JSON-able metadata;
  2. `init_policy_process_group(worker_rank=p, ...)` / `init_rollout_process_group(rollout_rank=r, ...)`, all
     together, with every engine's metadata (policy workers' first): everyone meets at policy worker 0's store,
     compiles the same plan -- every HF tensor is held by each of the T policy workers (NeMo-RL hands each of
     them whole HF tensors), and each of the R vLLM workers needs every whole tensor (NeMo-RL hands them to
     vLLM's `load_weights`) -- and opens the transport (torch.distributed: gloo on CPU, NCCL on GPUs);
  3. per refit, all together: `send_weights(weights)` on every policy worker: the generator is drained (it may
     run collectives) and only the slices the plan reads from this worker are kept -- the plan spreads the sending
     over all policy workers (each sends about 1/T of the model) and, with `fanout`, vLLM workers relay to each
     other so the policy workers send fewer copies; `receive_weight_batches()` on every vLLM worker: the whole
     transfer lands in this worker's buffers, is agreed complete by every process (and checksummed, on gloo), and
     only then are batches of at most `bucket_size` bytes yielded to vLLM's loaders -- a failed transfer yields
     nothing, so vLLM keeps its previous weights and NeMo-RL's refit raises;
  4. `finalize()` (NeMo-RL's shutdown, or after every refit with `release_after_refit`): the transport closes;
     the next refit starts again at 1.

Before sending, NeMo-RL's Megatron policy worker asks `get_target_weight_layout()` and filters its HF iterator
with it: this engine answers with every tensor the plan does not read from this worker as a missing prefix (and
its experts as owned expert ids), so the policy worker does not even keep the tensors other workers send.
"""
from __future__ import annotations

import asyncio
import bisect
import json
import re
from collections.abc import AsyncGenerator, Generator
from typing import Any

import torch

from ..errors import ArgumentError, ExecutionError
from ..layouts import HfLayout, ModelSpec, VllmLayout

TRANSPORTS = ("collective",)  # the cross-process transport whose sources may arrive at each refit
_EXPERT = re.compile(r"^(?P<block>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class ReshardCheckpointEngine:
    """One policy or vLLM worker's end of NeMo-RL's checkpoint-engine refit (see the module docstring).

    Selected in NeMo-RL's config as `policy.generation.refit_transport:
    "reshard.integrations.nemo_rl:ReshardCheckpointEngine"`; NeMo-RL constructs it with `bucket_size` and the
    matching `refit_cfg` entry as keyword arguments.

    Args:
        bucket_size: bytes per batch handed to vLLM's loaders (NeMo-RL's resolved bucket size).
        model: the HF checkpoint directory or config.json of the model vLLM serves (a dict of its config also
            works).
        transport: "collective" (torch.distributed over a group both sides join at policy worker 0's store).
        host: an address of this worker's own host for its store (None, the default: discovered where each worker
            runs -- RESHARD_HOST, the Ray node IP, the default route's interface; only policy worker 0's store is
            used). A config naming one node's address would be wrong on every other node, so it is refused there.
        fanout: vLLM workers relaying to at most this many others (None: the policy workers feed every one).
        checksum: hash every message and compare before anything is handed to vLLM (True: sha256, or "sum64";
            None: on with gloo; the executor hashes CPU tensors only, so NCCL refits rely on its completion
            agreement alone).
        backend: the torch.distributed backend (None: NCCL where CUDA is available, else gloo; the same on every
            worker).
        device: where vLLM workers receive (None: CUDA when available, else CPU).
        dtype: the dtype the policy sends and vLLM loads (None: the checkpoint config's), e.g. "bfloat16".
        timeout: seconds any wait may go without progress.
        release_after_refit: NeMo-RL's key (its synchronizer then calls finalize after every refit); kept.
        **unknown: any other key of the refit_cfg entry (NeMo-RL passes them all): refused, naming it.

    Raises:
        ArgumentError: an option of the wrong type or value (checked at construction, before any worker
            joins).
        ExecutionError: from the refit methods, a peer that failed or a tensor the plan does not expect; nothing
            is yielded to vLLM, which keeps its weights.
    """

    shard_expert_weights: bool = False  # NeMo-RL's own expert-sharding loader stays off: the plan says who sends what

    def __init__(self, bucket_size: int, *, model: str | dict[str, Any] | None = None,
                 transport: str = "collective", host: str | None = None, fanout: int | None = None,
                 checksum: bool | str | None = None, backend: str | None = None, device: str | None = None,
                 dtype: str | None = None, timeout: float = 300.0, release_after_refit: bool = False,
                 **unknown: Any) -> None:
        if unknown:  # NeMo-RL passes every key of the refit_cfg entry (its schema allows extra keys): a typo lands here
            _refuse_unknown(unknown)
        if not isinstance(bucket_size, int) or isinstance(bucket_size, bool) or bucket_size < 1:
            raise ArgumentError("bucket_size", bucket_size, "must be a positive number of bytes")
        if model is None:
            raise ArgumentError("model", None, "is required", fix="add `model: <the HF checkpoint vLLM serves>` to "
                                "refit_cfg's entry for this engine")
        if transport not in TRANSPORTS:
            raise ArgumentError("transport", transport, f"must be one of {TRANSPORTS}")
        if fanout is not None and (not isinstance(fanout, int) or isinstance(fanout, bool) or fanout < 1):
            raise ArgumentError("fanout", fanout, "must be a positive integer or None")
        if not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400:
            raise ArgumentError("timeout", timeout, "must be a number of seconds in (0, 86400]")
        from ..executors.checksum import algorithm

        # resolved here, not from the tensors at the first refit: the policy side has none when the group opens
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if self.backend not in ("gloo", "nccl"):
            raise ArgumentError("backend", backend, "must be 'gloo', 'nccl' or None")
        if checksum is None:
            checksum = self.backend == "gloo"
        algorithm(checksum)  # raises ArgumentError for an unknown one
        if checksum and self.backend != "gloo":
            raise ArgumentError("checksum", checksum, f"needs the gloo backend (CPU tensors); backend is "
                                f"{self.backend!r}", fix="leave checksum unset on GPUs")
        self.bucket_size, self.transport, self.fanout, self.checksum = bucket_size, transport, fanout, checksum
        self.spec = ModelSpec.from_hf_config(model)
        if dtype is not None:
            self.spec = self.spec.model_copy(update={"dtype": dtype})
            ModelSpec(**self.spec.model_dump())  # validated (an unknown dtype raises, naming it)
        if host is not None:  # every engine hosts a store at prepare(): an address of another node fails here, at once
            from ..addresses import check_local

            try:
                check_local(host, "refit_cfg host")
            except ArgumentError as e:  # the same config reaches every node: say why a node's address cannot work
                raise ArgumentError("refit_cfg host", host, f"{e.rule}; NeMo-RL gives every policy and vLLM worker "
                                    f"the same refit_cfg entry, so an address of one node is wrong on all others",
                                    fix="remove `host`: each worker finds its own address; RESHARD_HOST in a "
                                        "node's environment chooses among a multi-homed node's addresses"
                                    ) from None
        self.host = host
        self.device, self.timeout = device, float(timeout)
        self.release_after_refit = bool(release_after_refit)
        self._reset()

    def _reset(self) -> None:
        self.role: str | None = None  # "policy" or "rollout" once a process group is joined
        self.rank = -1
        self.refit_spec: Any = None
        self.executor: Any = None
        self.store: Any = None
        self.offer: Any = None  # the rendezvous this engine hosts after prepare()
        self.needed: frozenset[str] = frozenset()  # policy: the tensors the plan reads from this worker
        self.buffers: dict[str, torch.Tensor] = {}  # rollout: the whole model, received before vLLM sees any
        self.last_stats: Any = None
        self._scratch: torch.Tensor | None = None  # policy: stand-ins for the tensors other workers send

    # --- 1. prepare ------------------------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        """Host a rendezvous store (only policy worker 0's is used) and say what this engine was built for."""
        from ..adapters import rendezvous as rv

        self.offer, self.store = rv.host_store(rv.Rendezvous.new(self.host, timeout=min(self.timeout, 300.0)))
        return {"reshard": self._settings(), "rendezvous": self.offer.to_dict()}

    def _settings(self) -> dict[str, Any]:
        """Plain JSON values (they are compared after travelling through Ray or vLLM's RPC)."""
        return json.loads(json.dumps({"model": self.spec.model_dump(), "transport": self.transport,
                                      "fanout": self.fanout, "checksum": self.checksum, "backend": self.backend}))

    # --- 2. meet -----------------------------------------------------------------------------------------
    def init_policy_process_group(self, *, worker_rank: int, train_world_size: int, rollout_world_size: int,
                                  metadata: list[Any]) -> None:
        """Policy worker `worker_rank` joins: source rank `worker_rank` of the plan."""
        self._join("policy", worker_rank, train_world_size, rollout_world_size, metadata)
        ops = self.refit_spec.plan().ops_sent_by(worker_rank)
        names = self.refit_spec.plan().src_tensors
        self.needed = frozenset(names.name(int(t)) for t in set(ops["src_tensor"].tolist()))

    def init_rollout_process_group(self, *, rollout_rank: int, train_world_size: int, rollout_world_size: int,
                                   metadata: list[Any]) -> None:
        """vLLM worker `rollout_rank` joins: destination rank `rollout_rank` of the plan."""
        self._join("rollout", rollout_rank, train_world_size, rollout_world_size, metadata)

    def _join(self, role: str, rank: int, train_world_size: int, rollout_world_size: int,
              metadata: list[Any]) -> None:
        from ..adapters.refit import RefitSpec, open_transport
        from ..adapters import rendezvous as rv
        from ..executors.local import empty_for

        T, R = train_world_size, rollout_world_size
        for field, value in (("train_world_size", T), ("rollout_world_size", R)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ArgumentError(field, value, "must be a positive integer")
        size = T if role == "policy" else R
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < size:
            raise ArgumentError("worker_rank" if role == "policy" else "rollout_rank", rank, f"must be in [0, {size})")
        if self.offer is None:
            raise ExecutionError("init_*_process_group before prepare(): NeMo-RL prepares every engine first")
        rdv = self._check_metadata(metadata, T + R)
        if self.executor is not None:  # joined before without finalize: leave that group
            self.executor.close()
            self.executor = None
        refit = RefitSpec.of(self.spec, HfLayout(model=self.spec, replicas=T),
                             VllmLayout(model=self.spec, tp=1, replicas=R), install="loader",
                             transport=self.transport, fanout=self.fanout, rendezvous=rdv,
                             options={"checksum": self.checksum, "timeout": self.timeout, "backend": self.backend})
        plan = refit.plan()  # the same plan on every worker: a pure function of the model and the two sizes
        process = rank if role == "policy" else T + rank
        mine = rv.Rendezvous.from_dict(rdv)
        if role == "policy" and rank == 0:
            if mine.refit_id != self.offer.refit_id:
                raise ArgumentError("metadata", "entry 0", "must be policy worker 0's own prepare() result (NeMo-RL "
                                    "lists policy workers first, sorted by rank)")
        else:  # only policy worker 0's store is used
            self.store = rv.connect(mine)
        dst: dict[int, dict[str, torch.Tensor]] = {}
        if role == "rollout":
            device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
            self.buffers = empty_for(plan, rank, device)
            dst = {rank: self.buffers}
        rv.join(self.store, mine, process, T + R, role)
        self.executor = open_transport(refit, process, {}, dst, store=self.store)
        self.role, self.rank, self.refit_spec = role, rank, refit

    def _check_metadata(self, metadata: Any, n: int) -> dict[str, Any]:
        """Every engine's prepare() result, policy workers' first; every one built for the same refit. Returns
        the rendezvous of the first (policy worker 0's)."""
        if not isinstance(metadata, list) or len(metadata) != n:
            got = f"{len(metadata)} entries" if isinstance(metadata, list) else type(metadata).__name__
            raise ArgumentError("metadata", got, f"must list one prepare() result per worker ({n}: policy workers "
                                                 f"first)")
        ours = self._settings()
        differ = [k for k, m in enumerate(metadata) if not isinstance(m, dict) or m.get("reshard") != ours
                  or not isinstance(m.get("rendezvous"), dict)]
        if differ:
            raise ArgumentError("metadata", f"entries {differ[:10]}",
                                "come from engines built with other settings (model, transport, fanout, checksum, "
                                "backend) or from another checkpoint engine",
                                fix="give every worker the same refit_cfg entry")
        return metadata[0]["rendezvous"]

    # --- 3. a refit --------------------------------------------------------------------------------------
    def get_target_weight_layout(self) -> dict[str, Any] | None:
        """NeMo-RL's VllmWeightLayout for this policy worker: tensors the plan reads from other workers are
        "missing" (dropped from the iterator before they are kept); experts this worker sends are listed by id."""
        if self.role != "policy":
            return None
        names = sorted(t.name for t in self.spec.tensors)
        kept = sorted(self.needed)
        missing = [n for n in names if n not in self.needed and not _prefixes_any(n, kept)]
        experts: dict[str, set[int]] = {}
        for name in kept:
            m = _EXPERT.match(name)
            if m:
                leaf = "w2_weight" if m["proj"] == "down_proj" else "w13_weight"
                experts.setdefault(f"{m['block']}.routed_experts.{leaf}", set()).add(int(m["expert"]))
        return {"expert_params": {p: {"tp_rank": 0, "tp_size": 1, "local_expert_ids": sorted(ids)}
                                  for p, ids in sorted(experts.items())},
                "missing_weight_prefixes": missing}

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None]) -> None:
        """Drain `weights` (every policy worker must: it may run collectives), keep what the plan reads from this
        worker, and send it. Raises ExecutionError, on every worker, if the refit failed."""
        if self.role != "policy":
            raise ExecutionError("send_weights on an engine that is not a joined policy worker "
                                 "(call init_policy_process_group first)")
        kept: dict[str, torch.Tensor] = {}
        unknown: list[str] = []
        known = {t.name for t in self.spec.tensors}
        for name, tensor in weights:
            if name in self.needed:  # a copy: an exporter may reuse the tensor it yields for the next one
                kept[name] = tensor.detach().clone(memory_format=torch.contiguous_format)
            elif name not in known:
                unknown.append(name)
        if unknown:  # vLLM would miss these: withhold this worker's tensors (the executor checks every tensor of its
            # source table, which lists the whole model on every policy worker), so every process refuses the refit
            await self._transfer({self.rank: {}}, quiet=True)
            raise ExecutionError(f"the policy sent {len(unknown)} tensors the model {self.spec.family} does not have "
                                 f"(e.g. {unknown[:3]}): refit refused before a byte moved")
        await self._transfer({self.rank: self._with_stand_ins(kept)})

    def _with_stand_ins(self, kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`kept` plus a stand-in for every other tensor of the model: the executor checks every tensor its plan's
        source table lists for this worker (every tensor: each policy worker holds the whole model), but reads only
        the kept ones. The stand-ins are views of one scratch buffer (sources may share memory)."""
        from ..executors.local import element_shape, torch_dtype

        plan = self.refit_spec.plan()
        device = next(iter(kept.values())).device if kept else torch.device(self.device or "cpu")
        unit, own = torch_dtype(plan.src.dtype), plan.src_tensors.own_dtypes()
        others = {}
        for name, units in plan.src_tensors.on_rank(self.rank).items():
            if name not in kept:
                dtype = torch_dtype(own[(self.rank, name)]) if (self.rank, name) in own else unit
                others[name] = (element_shape(units, unit, dtype), dtype)
        nbytes = max((torch.Size(shape).numel() * dtype.itemsize for shape, dtype in others.values()), default=0)
        if self._scratch is None or self._scratch.numel() < nbytes or self._scratch.device != device:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8, device=device)
        out = dict(kept)
        for name, (shape, dtype) in others.items():
            n = torch.Size(shape).numel() * dtype.itemsize
            out[name] = self._scratch[:n].view(dtype).view(shape)
        return out

    async def receive_weight_batches(self) -> AsyncGenerator[list[tuple[str, torch.Tensor]], None]:
        """The whole model into this worker's buffers (checksummed, agreed by every process), then batches of
        whole HF tensors of at most `bucket_size` bytes (a larger tensor alone), in model order."""
        if self.role != "rollout":
            raise ExecutionError("receive_weight_batches on an engine that is not a joined vLLM worker "
                                 "(call init_rollout_process_group first)")
        await self._transfer(None)
        batch: list[tuple[str, torch.Tensor]] = []
        size = 0
        for t in self.spec.tensors:
            buf = self.buffers[t.name]
            if batch and size + buf.nbytes > self.bucket_size:
                yield batch
                batch, size = [], 0
            batch.append((t.name, buf))
            size += buf.nbytes
        if batch:
            yield batch

    async def _transfer(self, src: dict[int, dict[str, torch.Tensor]] | None, quiet: bool = False) -> None:
        run = (lambda: self.executor.refit()) if src is None else (lambda: self.executor.refit(src=src))
        try:
            self.last_stats = await asyncio.to_thread(run)
        except ExecutionError as e:
            if quiet:
                return
            raise ExecutionError(f"reshard refit failed on {self.role} worker {self.rank}; vLLM keeps its previous "
                                 f"weights: {e}") from e

    # --- 4. finalize ---------------------------------------------------------------------------------------
    def finalize(self) -> None:
        """Close the transport and the store; prepare() starts the next meeting."""
        if self.executor is not None:
            self.executor.close()
        self._reset()


def _refuse_unknown(unknown: dict[str, Any]) -> None:
    """ArgumentError naming every key of the refit_cfg entry this engine does not take (with the closest option)."""
    import difflib
    import inspect

    options = [p for p in inspect.signature(ReshardCheckpointEngine.__init__).parameters
               if p not in ("self", "bucket_size", "unknown")]
    names = sorted(unknown)
    hints = [f"{n!r} -> {close[0]!r}" for n in names if (close := difflib.get_close_matches(n, options, 1))]
    raise ArgumentError(f"refit_cfg key{'s' if len(names) > 1 else ''} {', '.join(map(repr, names))}",
                        rule=f"{'are not options' if len(names) > 1 else 'is not an option'} of ReshardCheckpointEngine (NeMo-RL passes every key of its refit_cfg "
                             f"entry to the constructor); its options: {', '.join(options)}",
                        fix=f"did you mean {'; '.join(hints)}" if hints else "remove it")


def _prefixes_any(name: str, sorted_names: list[str]) -> bool:
    """Whether `name` is a proper prefix of one of `sorted_names` (NeMo-RL drops every name a missing prefix
    starts: such a name cannot be listed without dropping the other)."""
    i = bisect.bisect_right(sorted_names, name)
    return i < len(sorted_names) and sorted_names[i].startswith(name)


__all__ = ["ReshardCheckpointEngine"]
