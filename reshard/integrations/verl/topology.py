"""The plan side of reshard's verl backend: pure data, no verl, no processes (testable anywhere).

Every trainer rank gets the same stream of gathered HF tensors and every rollout rank hands whole HF tensors to
vLLM's `load_weights` (verl/workers/engine_workers.py, `ActorRolloutRefWorker.update_weights`), so the source is
the HF layout replicated on the M trainer ranks and the destination the same on the N rollout ranks. Unlike
verl's own backends, the compiler spreads every tensor's bytes over all M holders and, with `fanout`, feeds one
rollout rank that relays to the others. One plan per tensor group of at most `bucket_size` bytes
(integrations.groups), compiled once in the driver and once per process, checked by digest.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from ...errors import ArgumentError, ExecutionError
from ...executors.binding import Binding
from ...layouts import ModelSpec
from ...planner import Plan
from .. import groups
from ..groups import DEPTH, tensor_groups

OPTIONS = tuple(groups.OPTION_TYPES)  # what engine_kwargs.reshard holds
# where verl holds the rollout's generation for a whole refit (verl 0.9.1; docs/guides/verl.md has the rest)
SERVING_WHY = ("verl's CheckpointEngineManager.update_weights aborts the rollout's requests and frees its KV cache "
               "before it calls any backend and resumes them after the last (verl/checkpoint_engine/base.py:523-560), "
               "and every trainer that refits a generating rollout (fully_async_policy, separate_async) uses it")


def check_options(options: dict[str, Any]) -> dict[str, Any]:
    """The backend's options (`engine_kwargs.reshard` in verl's config) as plain JSON values.

    Raises:
        ArgumentError: an unknown option (`atomic`, replaced by `staging`, is named with its replacement; refit
            while serving, `pause_for` and `staging` "device" / "host", with why not), a value of the wrong type
            or outside its range, `delta` without what it needs (groups.check_options).
    """
    groups.refuse_serving(options, "engine_kwargs.reshard.", SERVING_WHY, "verl")
    if "atomic" in options:
        raise ArgumentError("engine_kwargs.reshard.atomic", options["atomic"], "was replaced by `staging`",
                            fix="staging: model for all or nothing (atomic: true; one copy of the model per "
                                "rollout rank), or leave staging unset for bucket (bounded memory, a failed refit "
                                "can leave some groups of the new version loaded)")
    groups.refuse_unknown(options, OPTIONS, "unknown engine_kwargs.reshard", "the reshard backend")
    return groups.check_options(options, "engine_kwargs.reshard.")


def model_digest(spec: ModelSpec) -> str:
    """A short digest of the model's spec: every rank of a refit must be configured with the same model."""
    return hashlib.sha256(spec.model_dump_json().encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RefitAssignment:
    """What one process of one refit needs (verl's `topology`), as a JSON object: the model, both sides' sizes, the
    bucket, the options, the driver's plan digests, the rendezvous and the refit's version (trainer rank 0's refit
    count: what delta refits number). Process p < trainers is trainer rank p, the others rollout ranks
    p - trainers."""

    model: dict[str, Any]
    trainers: int
    rollouts: int
    bucket_size: int
    options: dict[str, Any]
    digests: tuple[str, ...]
    rendezvous: dict[str, Any]
    process: int
    version: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "digests", tuple(self.digests))
        for name in ("trainers", "rollouts", "bucket_size", "process", "version"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "process" else 1):
                raise ArgumentError(f"topology.{name}", value, "must be a positive integer")
        if self.process >= self.trainers + self.rollouts:
            raise ArgumentError("topology.process", self.process,
                                f"is outside the refit's {self.trainers + self.rollouts} processes")

    def to_dict(self) -> dict[str, Any]:
        """The assignment as a JSON object (what travels to the process)."""
        return json.loads(json.dumps({**asdict(self), "digests": list(self.digests)}))

    @classmethod
    def from_dict(cls, d: Any) -> "RefitAssignment":
        """The assignment a JSON object describes.

        Raises:
            ArgumentError: not an object with exactly the assignment's fields, or a bad size or process.
        """
        if not isinstance(d, dict) or set(d) != set(cls.__dataclass_fields__):
            raise ArgumentError("topology", type(d).__name__ if not isinstance(d, dict) else sorted(d),
                                f"must be an object with exactly {sorted(cls.__dataclass_fields__)}")
        return cls(**d)

    @property
    def is_trainer(self) -> bool:
        """Whether this process is a trainer rank."""
        return self.process < self.trainers

    @property
    def spec(self) -> ModelSpec:
        """The model."""
        return ModelSpec(**self.model)

    def plans(self) -> list[Plan]:
        """Every group's plan (compiled once per process), checked against the driver's digests."""
        plans = group_plans(self.spec, self.trainers, self.rollouts, self.bucket_size, self.options)
        mine = tuple(p.digest for p in plans)
        if mine != self.digests:
            raise ExecutionError(f"this process compiled plans {mine[:3]}... for the refit, the driver "
                                 f"{self.digests[:3]}...: the two sides disagree on the model or options")
        return plans


def group_plans(spec: ModelSpec, trainers: int, rollouts: int, bucket_size: int,
                options: dict[str, Any]) -> list[Plan]:
    """One plan per tensor group; with `fanout`, the trainers feed one rollout rank, which relays to the others."""
    return groups.group_plans(spec, trainers, rollouts, tensor_groups(spec, bucket_size), options.get("fanout"),
                              roots=1)


def _same_host(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two ranks' `node` records (engine.node_here) name one host (unknown counts as the same)."""
    if a.get("id") and b.get("id"):
        return a["id"] == b["id"]
    if a.get("address") and b.get("address"):
        return a["address"] == b["address"]
    return True


def check_store_address(trainers: int, metadata: Sequence[dict[str, Any]]) -> None:
    """Refuse, in the driver, a store at a loopback address while some rank runs on another host (it could not
    connect, and the others would wait for it until their timeout)."""
    from ...addresses import is_loopback

    host = (metadata[0].get("rendezvous") or {}).get("host")
    if not isinstance(host, str) or not is_loopback(host):
        return
    master = metadata[0].get("node") or {}
    away = [i for i, m in enumerate(metadata) if not _same_host(master, m.get("node") or {})]
    if not away:
        return
    names = [f"trainer rank {i}" if i < trainers else f"rollout rank {i - trainers}" for i in away]
    elsewhere = sorted({str((metadata[i].get("node") or {}).get("address")) for i in away})
    source = metadata[0].get("host_source", "the store address")
    raise ArgumentError(source, host, f"is a loopback address: trainer rank 0 hosts the refit's store there, which "
                        f"only its own host ({master.get('address')}) reaches, but {', '.join(names[:6])}"
                        f"{' ...' if len(names) > 6 else ''} run on another host ({', '.join(elsewhere)})",
                        fix="leave engine_kwargs.reshard.host and RESHARD_HOST unset: trainer rank 0 then publishes "
                            "the address its Ray node is reached at")


def build(trainers: int, rollouts: int, metadata: Sequence[Any]) -> tuple[list[dict], list[dict]]:
    """`build_topology`'s work: check every rank's `prepare()` metadata, compile the plans and give each process
    its RefitAssignment (trainers', rollouts')."""
    if len(metadata) != trainers + rollouts:
        raise ArgumentError("metadata", len(metadata), f"entries, expected {trainers} trainer + {rollouts} rollout")
    roles = ["trainer"] * trainers + ["rollout"] * rollouts
    problems = [f"entry {i} should come from a {role} rank of the reshard backend, got "
                f"{m.get('role') if isinstance(m, dict) else type(m).__name__}"
                for i, (m, role) in enumerate(zip(metadata, roles)) if not isinstance(m, dict) or m.get("role") != role]
    if problems:
        raise ArgumentError("metadata", problems, "(is every rank's checkpoint_engine.backend 'reshard'?)")
    first = metadata[0]
    if not first.get("master") or any(m.get("master") for m in metadata[1:]):
        raise ArgumentError("metadata", [bool(m.get("master")) for m in metadata],
                            "must have trainer rank 0 as the one master (it hosts the refit's store)")
    check_store_address(trainers, metadata)
    for key in ("model_digest", "bucket_size", "options"):
        values = {json.dumps(m.get(key), sort_keys=True) for m in metadata}
        if len(values) > 1:
            raise ArgumentError(f"metadata.{key}", sorted(values), "differs between ranks: every trainer and "
                                "rollout rank must be configured with the same model, bucket and options")
    spec = ModelSpec(**first["model"])
    if model_digest(spec) != first["model_digest"]:
        raise ArgumentError("metadata.model", first["model_digest"], "does not match its digest")
    options = check_options(first["options"])
    plans = group_plans(spec, trainers, rollouts, first["bucket_size"], options)
    if options.get("transport", "collective") == "collective":  # a bucket must hold the wire buffers
        from ...executors.collective.schedule import bucket_numel_for

        for plan in plans:
            try:
                bucket_numel_for(plan, Binding.disjoint(trainers, rollouts), first["bucket_size"], None, DEPTH)
            except ExecutionError as e:
                raise ArgumentError("bucket_size", first["bucket_size"], f"is smaller than the wire buffers the plan "
                                    f"must hold to move its tensors in one message each ({e})",
                                    fix="raise update_weights_bucket_megabytes") from None
    base = dict(model=spec.model_dump(), trainers=trainers, rollouts=rollouts, bucket_size=first["bucket_size"],
                options=options, digests=tuple(p.digest for p in plans), rendezvous=first["rendezvous"],
                version=first.get("version", 1))
    tops = [RefitAssignment(**base, process=p).to_dict() for p in range(trainers + rollouts)]
    return tops[:trainers], tops[trainers:]


__all__ = ["OPTIONS", "RefitAssignment", "build", "check_options", "check_store_address", "group_plans", "model_digest"]
