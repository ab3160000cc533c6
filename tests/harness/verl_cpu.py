"""verl's own refit machinery on CPU, for tests and benchmarks of reshard's verl backend (never for production).

verl's real `CheckpointEngineManager` drives the backend between:
- trainer workers: verl's `ActorRolloutRefWorker` (its own `update_weights`, which streams
  `actor.engine.get_per_tensor_param()` into the checkpoint engine); only `init_model` is replaced, since verl's
  engines need GPUs: each worker builds a real megatron-core GPT (local spec: fused QKV, gated MLP, experts) on
  CPU, data-parallel over the trainer workers (gloo), and exports it as gathered HF tensors the way Megatron-Bridge
  does for verl (QKV split per query group, fc1 into gate / up, experts one by one, padded vocabulary cut); or
  (`HfExport`) loads the transformers model of the served checkpoint and streams its state dict, as verl's FSDP
  engine does; either stream takes injected faults (`faulty`);
- rollout workers: verl's `CheckpointEngineWorker` with a server adapter that stands in for vLLM's: it holds the
  checkpoint transformers saved for the same model and copies each received tensor into it, refusing an unknown
  name or shape and a refit that misses a tensor, records what each update was handed, and sets verl's version
  only after a complete update (as vLLM's adapter calls `set_global_steps`); tests make it wait at, or raise on,
  a chosen tensor of an update (a slow or a failing load);
- replicas: verl's `RolloutReplica` without servers (nothing to abort or resume on CPU).
Imports verl and Ray (megatron-core for the megatron model); run in the verl virtualenv.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import ray
import torch
from omegaconf import OmegaConf
from verl.checkpoint_engine import (CheckpointEngine, CheckpointEngineManager, CheckpointEngineRegistry,
                                   CheckpointEngineWorker)
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.import_utils import import_external_libs
from verl.workers.config import CheckpointEngineConfig, RolloutConfig
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.rollout import BaseRollout, RolloutReplica

from reshard.layouts import ModelSpec
from reshard.ports import free_port
from reshard.testing.megatron_cpu import TinyGPT

from . import pythonpath

MOE = TinyGPT(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, head_dim=16,
              ffn_hidden_size=96, vocab_size=5000, padded_vocab_size=5008, num_experts=4, moe_ffn_hidden_size=32)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def save_checkpoint(tiny: TinyGPT, directory: Path) -> Path:
    """What the rollout serves before the first refit: transformers' own checkpoint of the model (its names)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny.hf_config(), dtype=torch.float32)
    model.save_pretrained(directory)
    return directory


# --- trainer side ----------------------------------------------------------------------------------------------

def megatron_to_hf(named: dict[str, torch.Tensor], tiny: TinyGPT):
    """Gathered HF tensors of a TP=1 megatron-core GPT (local spec), in the order Megatron-Bridge exports them."""
    hd, heads, groups = tiny.head_dim, tiny.num_attention_heads, tiny.num_query_groups
    per = heads // groups
    yield "model.embed_tokens.weight", named["embedding.word_embeddings.weight"][:tiny.vocab_size]
    for i in range(tiny.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        yield h + "input_layernorm.weight", named[m + "input_layernorm.weight"]
        qkv = named[m + "self_attention.linear_qkv.weight"].view(groups, (per + 2) * hd, -1)
        yield h + "self_attn.q_proj.weight", qkv[:, :per * hd].reshape(heads * hd, -1)
        yield h + "self_attn.k_proj.weight", qkv[:, per * hd:(per + 1) * hd].reshape(groups * hd, -1)
        yield h + "self_attn.v_proj.weight", qkv[:, (per + 1) * hd:].reshape(groups * hd, -1)
        yield h + "self_attn.o_proj.weight", named[m + "self_attention.linear_proj.weight"]
        yield h + "self_attn.q_norm.weight", named[m + "self_attention.q_layernorm.weight"]
        yield h + "self_attn.k_norm.weight", named[m + "self_attention.k_layernorm.weight"]
        yield h + "post_attention_layernorm.weight", named[m + "pre_mlp_layernorm.weight"]
        if tiny.num_experts:
            yield h + "mlp.gate.weight", named[m + "mlp.router.weight"]
            for e in range(tiny.num_experts):
                fc1 = named[f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight"]
                half = fc1.shape[0] // 2
                yield f"{h}mlp.experts.{e}.gate_proj.weight", fc1[:half]
                yield f"{h}mlp.experts.{e}.up_proj.weight", fc1[half:]
                fc2 = named[f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight"]
                yield f"{h}mlp.experts.{e}.down_proj.weight", fc2
        else:
            fc1 = named[m + "mlp.linear_fc1.weight"]
            half = fc1.shape[0] // 2
            yield h + "mlp.gate_proj.weight", fc1[:half]
            yield h + "mlp.up_proj.weight", fc1[half:]
            yield h + "mlp.down_proj.weight", named[m + "mlp.linear_fc2.weight"]
    yield "model.norm.weight", named["decoder.final_layernorm.weight"]
    yield "lm_head.weight", named["output_layer.weight"][:tiny.vocab_size]


class MegatronExport:
    """Stands in for verl's MegatronEngine behind `get_per_tensor_param`: a live megatron-core model whose HF
    export every trainer rank streams (with faults to inject for tests)."""

    def __init__(self, tiny: TinyGPT) -> None:
        from reshard.testing import megatron_cpu

        megatron_cpu.apply_cpu_patches()
        megatron_cpu.init_parallel(tp=1)
        self.tiny = tiny
        self.chunks = megatron_cpu.build_model(tiny)
        self.fault: dict[str, Any] = {}

    def named(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.chunks[0].named_parameters()}

    def train_step(self, step: int, fraction: float = 1.0) -> None:
        """A deterministic update, the same on every data-parallel rank (of a `fraction` of the elements)."""
        with torch.no_grad():
            for k, (_, p) in enumerate(sorted(self.chunks[0].named_parameters())):
                p.add_(_update(p, step * 1000 + k, fraction))

    def get_per_tensor_param(self, **_: Any):
        return faulty(megatron_to_hf(self.named(), self.tiny), self.fault), None


def _update(p: torch.Tensor, seed: int, fraction: float) -> torch.Tensor:
    """A step's change of `p`: N(0, 0.01) noise, at a random `fraction` of the elements (1: all of them)."""
    gen = torch.Generator().manual_seed(seed)
    change = 0.01 * torch.randn(p.shape, generator=gen)
    if fraction < 1.0:
        change *= torch.rand(p.shape, generator=gen) < fraction
    return change


class HfExport:
    """Stands in for verl's FSDP engine behind `get_per_tensor_param`: a transformers model (loaded from the
    checkpoint the rollout serves) streamed as its state dict, in the state dict's order (with faults to inject)."""

    def __init__(self, checkpoint: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(checkpoint)
        self.fault: dict[str, Any] = {}

    def named(self) -> dict[str, torch.Tensor]:
        return {n: t.detach() for n, t in self.model.state_dict().items()}

    def train_step(self, step: int, fraction: float = 1.0) -> None:
        """A deterministic update, the same on every data-parallel rank (of a `fraction` of the elements)."""
        with torch.no_grad():
            for k, (_, p) in enumerate(sorted(self.model.named_parameters())):
                p.add_(_update(p, step * 1000 + k, fraction).to(p.dtype))

    def get_per_tensor_param(self, **_: Any):
        return faulty(iter(self.named().items()), self.fault), None


def faulty(stream, fault: dict[str, Any]):
    """`stream` with `fault` injected at item `fault["at"]` (-1: after the last item): "exit" kills the process,
    "wait" parks until the test says go, "extra" puts an unknown tensor before the item (-1: after the last),
    "skip" drops it, "repeat" streams it twice, "shape" cuts its last row. Records when the fault was injected
    (`fault["injected"]`: time.monotonic, a host-wide clock on Linux)."""
    n = -1
    for n, (name, tensor) in enumerate(stream):
        if fault.get("at") == n:
            fault["injected"] = time.monotonic()
            kind = fault["kind"]
            if kind == "exit":
                os._exit(17)  # the trainer process dies mid-refit
            if kind == "wait":  # park here until the test has done its damage
                Path(fault["reached"]).touch()
                deadline = time.monotonic() + 60
                while not Path(fault["go"]).exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
            if kind == "extra":
                yield "model.layers.0.mlp.not_a_tensor.weight", tensor
            if kind == "skip":
                continue
            if kind == "shape":
                tensor = tensor[:-1]
            if kind == "repeat":
                yield name, tensor
        yield name, tensor
    if fault.get("at") == -1 and fault.get("kind") == "extra":
        fault["injected"] = time.monotonic()
        yield "model.layers.0.mlp.not_a_tensor.weight", tensor


def new_engine(ce: dict[str, Any], **is_master: bool) -> Any:
    """The checkpoint engine as verl's workers make it (ActorRolloutRefWorker.init_model: with `is_master`;
    CheckpointEngineWorker.__init__: without)."""
    config: CheckpointEngineConfig = omega_conf_to_dataclass(OmegaConf.create(ce))
    import_external_libs(config.custom_backend_module or None)
    return CheckpointEngineRegistry.new(config.backend, bucket_size=config.update_weights_bucket_megabytes << 20,
                                        **is_master, **config.engine_kwargs.get(config.backend, {}))


class TrainerWorker(ActorRolloutRefWorker):
    """verl's trainer worker; `init_model` builds the CPU model and the checkpoint engine as verl's does."""

    def __init__(self, config: Any, role: str, tiny: dict[str, Any] | None, checkpoint: str) -> None:
        super().__init__(config, role)
        self.tiny, self.checkpoint = (TinyGPT(**tiny) if tiny else None), checkpoint

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("gloo")
        from types import SimpleNamespace

        engine = MegatronExport(self.tiny) if self.tiny is not None else HfExport(self.checkpoint)
        self.actor = SimpleNamespace(engine=engine)
        self.checkpoint_engine = new_engine(OmegaConf.to_container(self.config.rollout.checkpoint_engine),
                                            is_master=(torch.distributed.get_rank() == 0))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def reconfigure(self, ce: dict[str, Any]) -> None:
        """A new checkpoint engine from another config, made as init_model makes it (tests switch transports
        without restarting the cluster)."""
        self.checkpoint_engine = new_engine(ce, is_master=(torch.distributed.get_rank() == 0))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_step(self, step: int, fraction: float = 1.0) -> None:
        self.actor.engine.train_step(step, fraction)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def hf_digests(self) -> dict[str, str]:
        named = self.actor.engine.named()
        pairs = megatron_to_hf(named, self.tiny) if self.tiny is not None else named.items()
        return {name: digest(t) for name, t in pairs}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def where(self) -> dict[str, Any]:
        """This worker's node address (Ray's) and the address its checkpoint engine last hosted a store at."""
        rdv = getattr(self.checkpoint_engine, "_rdv", None)
        return {"node": ray.util.get_node_ip_address(), "store": rdv.host if rdv is not None else None}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_fault(self, fault: dict[str, Any], rank: int | None) -> None:
        """Inject `fault` into trainer rank `rank`'s stream (None: every rank's, as a real exporter's fault is)."""
        self.actor.engine.fault = dict(fault) if rank is None or self.rank == rank else {}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fault_injected(self) -> float | None:
        """When this rank's stream reached its fault (time.monotonic, a host-wide clock on Linux), or None."""
        return self.actor.engine.fault.get("injected")


# --- rollout side ----------------------------------------------------------------------------------------------

class CheckpointAdapter(BaseRollout):
    """Stands in for vLLM's server adapter: whole HF tensors into the served checkpoint, as `load_weights` takes
    them (an unknown name or shape is refused; a refit must bring every tensor)."""

    def __init__(self, config: RolloutConfig, checkpoint: str) -> None:
        super().__init__(config, None, device_mesh=None)
        from safetensors.torch import load_file

        self.weights = {n: t.clone() for n, t in load_file(str(Path(checkpoint) / "model.safetensors")).items()}
        self.version: int | None = None
        # per update_weights: its step, the names received in order, whether it completed, when it ended
        self.calls: list[dict[str, Any]] = []
        self.hold: str | None = None  # a path: each update waits at one tensor until the file exists
        self.hold_at = 0  # that tensor's position in the update (0: its first)
        self.fail_at: int | None = None  # an update raises when handed the tensor at this position (None: never)

    async def update_weights(self, weights, global_steps: int | None = None, **kwargs: Any) -> None:
        got = set()
        call = {"step": global_steps, "names": [], "ok": False, "ended": None}
        self.calls.append(call)
        try:
            async for name, tensor in weights:
                call["names"].append(name)
                deadline = time.monotonic() + 60
                while self.hold and len(call["names"]) == self.hold_at + 1 and not Path(self.hold).exists() \
                        and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)  # as a slow load would, without blocking the worker's event loop
                if self.fail_at == len(call["names"]) - 1:  # as vLLM's load_weights may (a device error, OOM)
                    raise RuntimeError(f"load_weights failed on {name} (tensor {self.fail_at} of the update: a "
                                       f"fault the test injected)")
                have = self.weights.get(name)
                if have is None or have.shape != tensor.shape or have.dtype != tensor.dtype:
                    raise ValueError(f"load_weights: {name} {tuple(tensor.shape)} {tensor.dtype} is not a parameter "
                                     f"of the served model")
                have.copy_(tensor)
                got.add(name)
            missing = sorted(set(self.weights) - got)
            if missing:
                raise ValueError(f"load_weights: the refit left {missing[:3]} ({len(missing)}) unset")
            self.version = global_steps  # as vLLM's adapter: set_global_steps only after a complete update
            call["ok"] = True
        finally:
            call["ended"] = time.monotonic()

    async def resume(self, tags: list[str]) -> None:
        pass

    async def release(self) -> None:
        pass


class RolloutWorker(CheckpointEngineWorker):
    def __init__(self, rollout_config: RolloutConfig, checkpoint: str) -> None:
        super().__init__(rollout_config, None, CheckpointAdapter(rollout_config, checkpoint))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def reconfigure(self, ce: dict[str, Any]) -> None:
        self.checkpoint_engine = new_engine(ce)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def where(self) -> dict[str, Any]:
        return {"node": ray.util.get_node_ip_address()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def served(self) -> tuple[int | None, dict[str, str]]:
        adapter = self.server_adapter
        return adapter.version, {name: digest(t) for name, t in adapter.weights.items()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def hold(self, path: str | None, at: int = 0) -> None:
        """Make the server adapter wait, at the tensor in position `at` of each update (0: its first), until `path`
        exists (None: never)."""
        self.server_adapter.hold, self.server_adapter.hold_at = path, at

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail_at(self, position: int | None) -> None:
        """Make the server adapter raise when handed the tensor in `position` of an update, before loading it, and
        leave the weights generator there, as an adapter's `async for` does (None: never)."""
        self.server_adapter.fail_at = position

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def moved(self) -> list[tuple[int, int]]:
        """The refit in flight as reshard's verl backend records it in the refit's store: per position whose gate
        is open, the group and how many processes finished moving it."""
        session, out = self.checkpoint_engine._session, []
        keys = session.agreement.keys if session is not None else None
        for i in range(len(session.plans) if session is not None else 0):
            if not keys.check([f"gate/{i}"]) or keys.get(f"gate/{i}") == b"closed":
                break
            k = int(keys.get(f"gate/{i}"))
            out.append((k, int(keys.add(f"done/{k}", 0))))
        return out

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def calls(self) -> list[dict[str, Any]]:
        """What the server adapter was handed, per update_weights call (CheckpointAdapter.calls)."""
        return self.server_adapter.calls

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def clear(self) -> None:
        """No hold or failure at any tensor, and no record of past updates (Refit.reset)."""
        adapter = self.server_adapter
        adapter.hold, adapter.hold_at, adapter.fail_at, adapter.calls = None, 0, None, []


class Replica(RolloutReplica):
    """A replica whose workers are given (no inference server on CPU: nothing to abort, release or resume)."""

    def get_ray_class_with_init_args(self):
        raise NotImplementedError

    async def launch_servers(self):
        pass


# --- the cluster -----------------------------------------------------------------------------------------------

def checkpoint_engine_config(checkpoint: str, bucket_mb: int = 1, backend: str = "reshard",
                             **options: Any) -> dict[str, Any]:
    kwargs = {"reshard": {"model": checkpoint, **options}} if backend == "reshard" else {backend: options}
    return {"_target_": "verl.workers.config.CheckpointEngineConfig", "backend": backend,
            "update_weights_bucket_megabytes": bucket_mb, "engine_kwargs": kwargs,
            "custom_backend_module": "reshard.integrations.verl" if backend == "reshard" else __name__}


class Refit:
    """M trainer workers, N rollout workers (TP 1 replicas), one manager: `refit(step)` as verl's trainer does."""

    def __init__(self, trainers: int, rollouts: int, checkpoint: str, ce: dict[str, Any], tiny: TinyGPT | None = MOE,
                 extra_modules: str | None = None, trainer_node: str | None = None,
                 rollout_node: str | None = None) -> None:
        """trainer_node / rollout_node: a Ray custom resource of the node each side's workers must run on (e.g.
        the two-host test bed's "host_a" / "host_b"); None: wherever Ray places them. tiny None: the trainers
        stream the transformers model of `checkpoint` (its state dict) instead of a megatron-core model's export."""
        self.checkpoint, self.ce, self.tiny = checkpoint, ce, tiny
        self.num_trainers, self.num_rollouts = trainers, rollouts
        self.trainer_node, self.rollout_node = trainer_node, rollout_node
        self._start_trainers()
        self._start_rollouts()
        self.manager = CheckpointEngineManager(CheckpointEngineConfig(**ce), self.trainers, self.replicas)

    def _start_trainers(self) -> None:
        config = OmegaConf.create({"actor": {"strategy": "fsdp"}, "rollout": {"checkpoint_engine": self.ce}})
        self.trainer_pool = resource_pool(self.num_trainers, self.trainer_node)
        self.trainers = worker_group(self.trainer_pool, TrainerWorker, config=config, role="actor",
                                     tiny=self.tiny.__dict__ if self.tiny else None, checkpoint=self.checkpoint)
        self.trainers.init_model()

    def _start_rollouts(self) -> None:
        self.rollout_config = RolloutConfig(name="vllm", tensor_model_parallel_size=1,
                                            checkpoint_engine=CheckpointEngineConfig(**self.ce))
        self.rollout_pool = resource_pool(self.num_rollouts, self.rollout_node)
        self.rollouts = worker_group(self.rollout_pool, RolloutWorker, rollout_config=self.rollout_config,
                                     checkpoint=self.checkpoint)
        self.replicas = [Replica(replica_rank=r, config=self.rollout_config, model_config=None)
                         for r in range(self.num_rollouts)]
        for r, replica in enumerate(self.replicas):
            replica.workers = self.rollouts.workers[r:r + 1]

    def replace_trainers(self, ce: dict[str, Any] | None = None) -> None:
        """New trainer workers (as verl restarts a failed trainer group) and a manager over them and the same
        rollout replicas."""
        _kill(self.trainers.workers, [self.trainer_pool])
        self.ce = ce or self.ce
        self._start_trainers()
        self.manager = CheckpointEngineManager(CheckpointEngineConfig(**self.ce), self.trainers,
                                               self.manager.replicas)

    def reset(self, ce: dict[str, Any]) -> None:
        """The reset point of workers shared between tests (tests/integration/verl/conftest.py): a side with a dead
        worker is started anew (as verl restarts a group), the manager refits every replica again, no fault, hold or
        failure is injected, the rollout workers' records of past updates are cleared and every checkpoint engine is
        made anew from `ce`. What the workers hold stays: the trainers' weights after their steps so far, the
        version and weights each rollout worker serves."""
        self.ce = ce
        if not _alive(self.trainers.workers):
            _kill(self.trainers.workers, [self.trainer_pool])
            self._start_trainers()
        if not _alive(self.rollouts.workers):
            _kill(self.rollouts.workers, [self.rollout_pool])
            self._start_rollouts()
        self.manager = CheckpointEngineManager(CheckpointEngineConfig(**ce), self.trainers, self.replicas)
        self.trainers.set_fault({}, None)
        self.rollouts.clear()
        self.reconfigure(ce)

    def reconfigure(self, ce: dict[str, Any]) -> None:
        """Every worker's checkpoint engine anew from `ce` (same backend class: the manager stays)."""
        self.trainers.reconfigure(ce)
        self.rollouts.reconfigure(ce)

    def drop_replica(self, r: int) -> None:
        """verl's elastic scale-down: the manager forgets replica r (e.g. after its worker died)."""
        self.manager.remove_replicas([self.replicas[r]])

    def refit(self, step: int) -> dict[str, float]:
        return self.manager.update_weights(global_steps=step)  # verl's auto_await runs it to completion

    def expected(self) -> dict[str, str]:
        return self.trainers.hf_digests()[0]

    def served(self) -> list[tuple[int | None, dict[str, str]]]:
        return self.rollouts.served()

    def served_by(self, ranks: list[int]) -> list[tuple[int | None, dict[str, str]]]:
        return ray.get([self.rollouts.workers[r].served.remote() for r in ranks])

    def kill_rollout(self, r: int) -> None:
        ray.kill(self.rollouts.workers[r], no_restart=True)

    def shutdown(self) -> None:
        _kill([*self.trainers.workers, *self.rollouts.workers], [self.trainer_pool, self.rollout_pool])


def worker_group(pool: RayResourcePool, cls: type, **init: Any) -> RayWorkerGroup:
    """verl's worker group of `cls` over `pool`, made with `init`. Its workers join one torch.distributed group in
    their constructors (verl's initialize_global_process_group_ray), at a port drawn on rank 0's node beforehand and
    bound once the workers start. Left to verl, that port is a bind(0) one, from the kernel's ephemeral range, which
    also gives every outgoing connection its port: CI saw rank 0's bind fail with EADDRINUSE, the port taken in
    between by another test's process. verl takes the first free port of `master_port_range` instead: its start
    is drawn here by reshard.ports.free_port, at random from outside that range."""
    port = free_port()
    return RayWorkerGroup(resource_pool=pool, device_name="cpu", master_port_range=[port, port + 16],
                          ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(cls), **init))


def resource_pool(workers: int, node: str | None = None) -> RayResourcePool:
    """verl's CPU resource pool of `workers` one-CPU bundles; with `node`, every bundle also asks for a little of
    that Ray custom resource, so the pool lands on the node that has it. verl builds a pool's placement groups from
    CPU (and GPU) counts only; a pool whose groups are made beforehand keeps them (`get_placement_groups` returns
    `pgs` once set, as verl's own SubRayResourcePool relies on)."""
    pool = RayResourcePool([workers], use_gpu=False, max_colocate_count=1)
    if node is not None:
        from ray.util.placement_group import placement_group

        group = placement_group([{"CPU": 1, node: 0.001}] * workers, strategy="STRICT_PACK",
                                name=f"{pool.name_prefix}{node}")
        ray.get(group.ready(), timeout=120)
        pool.pgs = [group]
    return pool


def _alive(workers: list) -> bool:
    """Whether every one of `workers` (Ray actors) answers; False once one has died (killed, or exited)."""
    try:
        ray.get([worker.__ray_ready__.remote() for worker in workers], timeout=60)
        return True
    except ray.exceptions.RayActorError:
        return False


def _kill(workers: list, pools: list) -> None:
    for worker in workers:
        try:
            ray.kill(worker, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
    for pool in pools:
        for pg in pool.get_placement_groups():
            ray.util.remove_placement_group(pg)


def start_ray(num_cpus: int = 16, address: str | None = None) -> None:
    """A local Ray cluster (or, with `address`, a driver of the running cluster there) whose workers import this
    checkout's reshard (logical CPUs: verl's pools ask for one per worker; the machine may have two)."""
    env = {"PYTHONPATH": pythonpath(os.environ.get("PYTHONPATH")),
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    if address is not None:
        ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=False)
        return
    ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env={"env_vars": env}, log_to_driver=False)



# --- verl's stock pattern, for benchmarks ----------------------------------------------------------------------

@CheckpointEngineRegistry.register("funnel")
class FunnelCheckpointEngine(CheckpointEngine):
    """verl's stock NCCL engine's pattern over gloo, for side-by-side benchmarks: trainer rank 0 alone packs the
    stream into buckets of whole tensors (larger ones in bucket-sized chunks) and broadcasts each to every rollout
    rank; the other trainer ranks only drain their streams. No checksums, no all-or-nothing."""

    def __init__(self, bucket_size: int, is_master: bool | None = None, timeout: float = 120.0) -> None:
        self.bucket_size, self.role = bucket_size, "rollout" if is_master is None else "trainer"
        self.is_master, self.timeout = bool(is_master), timeout
        self.store = self.pg = None
        self.rank = -1

    def prepare(self) -> dict[str, Any]:
        if self.is_master:
            import datetime

            self.store = torch.distributed.TCPStore("127.0.0.1", 0, None, True,
                                                    datetime.timedelta(seconds=self.timeout), wait_for_workers=False)
            return {"port": int(self.store.port)}
        return {}

    @classmethod
    def build_topology(cls, trainers: int, rollouts: int, metadata: list[dict]):
        port, world = metadata[0]["port"], 1 + rollouts
        return ({"rank": [0] + [-1] * (trainers - 1), "world": [world] * trainers, "port": [port] * trainers},
                {"rank": list(range(1, world)), "world": [world] * rollouts, "port": [port] * rollouts})

    def init_process_group(self, rank: int, world: int, port: int) -> None:
        import datetime

        self.rank = rank
        if rank < 0:
            return
        if self.store is None:
            self.store = torch.distributed.TCPStore("127.0.0.1", port, None, False,
                                                    datetime.timedelta(seconds=self.timeout))
        self.pg = torch.distributed.ProcessGroupGloo(torch.distributed.PrefixStore("funnel/", self.store), rank,
                                                     world, datetime.timedelta(seconds=self.timeout))
        self.world = world

    def finalize(self) -> None:
        self.pg = self.store = None

    def _bcast(self, t: torch.Tensor) -> None:
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([t], opts).wait()

    def _send(self, meta: list, bucket: torch.Tensor, used: int) -> int:
        header = json.dumps(meta).encode()
        self._bcast(torch.tensor([len(header), used], dtype=torch.int64))
        self._bcast(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        self._bcast(bucket[:used])
        return used * (self.world - 1)  # gloo's broadcast: the root sends to every other rank

    async def send_weights(self, weights, global_steps: int | None = None) -> dict[str, float]:
        if self.rank < 0:
            for _ in weights:
                pass
            return {}
        bucket = torch.empty(self.bucket_size, dtype=torch.uint8)
        meta, used, sent, start = [], 0, 0, time.perf_counter()
        for name, tensor in weights:
            raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
            for offset in range(0, max(raw.numel(), 1), self.bucket_size):
                piece = raw[offset:offset + self.bucket_size]
                if used + piece.numel() > self.bucket_size:
                    sent += self._send(meta, bucket, used)
                    meta, used = [], 0
                bucket[used:used + piece.numel()] = piece
                meta.append([name, list(tensor.shape), str(tensor.dtype).split(".")[1], offset, used, piece.numel()])
                used += piece.numel()
        sent += self._send(meta, bucket, used)
        self._bcast(torch.tensor([-1, 0], dtype=torch.int64))
        return {f"funnel/trainer{self.rank}/egress_bytes": float(sent),
                f"funnel/trainer{self.rank}/seconds": time.perf_counter() - start}

    async def receive_weights(self, global_steps: int | None = None):
        partial: dict[str, torch.Tensor] = {}
        while True:
            sizes = torch.empty(2, dtype=torch.int64)
            self._bcast(sizes)
            if int(sizes[0]) < 0:
                return
            header = torch.empty(int(sizes[0]), dtype=torch.uint8)
            self._bcast(header)
            bucket = torch.empty(int(sizes[1]), dtype=torch.uint8)
            self._bcast(bucket)
            for name, shape, dtype, offset, at, n in json.loads(bytes(header.numpy())):
                dt = getattr(torch, dtype)
                full = partial.setdefault(name, torch.empty(shape, dtype=dt))
                full.view(-1).view(torch.uint8)[offset:offset + n] = bucket[at:at + n]
                if offset + n == full.numel() * full.element_size():
                    yield name, partial.pop(name)


__all__ = ["CheckpointAdapter", "FunnelCheckpointEngine", "HfExport", "MOE", "MegatronExport", "ModelSpec", "Refit",
           "Replica", "RolloutWorker", "TrainerWorker", "checkpoint_engine_config", "digest", "faulty",
           "megatron_to_hf", "resource_pool", "save_checkpoint", "start_ray", "worker_group"]
