"""The trainer side of refits into inference engines (a vLLM server, Ray actors, the trainer's own processes).

One `TrainerSession` per trainer process; process 0 drives the engines (any `adapters.engines.EngineClient`).
Imports no vLLM:

    refit = RefitSpec.of(spec, MegatronLayout(...), VllmLayout(...), install="loader", transport="collective")
    session = TrainerSession(refit, process=rank, tensors=source_tensors(facts, layout),
                             engines=[VllmServer(url)] if rank == 0 else [], trainer_group=world)
    session.init()                  # every trainer process, together
    for step in ...:                # (pause_for="flip": the engines keep generating while the bytes land)
        train_step()
        session.refit(version=f"step-{step}")   # every trainer process, together
    session.close()
"""
from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..arguments import instance, integer, rank_tensors, seconds, text
from ..errors import ArgumentError, ExecutionError
from ..group_json import broadcast_json
from ..polling import Background, poll
from ..executors.base import Executor, RankTensors, RefitStats, close_within
from . import rendezvous as rv
from .engines import EngineCall, EngineClient, Leased, Pausable, ReportsInFlight, ReportsStaged, wait_calls
from .lease_renewal import LeaseRenewal
from .refit import RefitSpec, open_transport
from .placement_follow import agree, follow
from .transports import publish_source, withdraw_source


@dataclass
class RefitResult:
    """What one trainer process saw of one refit."""

    version: str
    seconds: float
    # start, transfer, engines (every engine's update returned), finish, resume; pause_for="flip": start,
    # transfer, staged, pause, flip (the install), finish, resume
    phases: dict[str, float] = field(default_factory=dict)
    stats: Any = None  # this process's executor stats, with the driver's pause_s and in_flight
    followed: list[dict[str, Any]] = field(default_factory=list)  # EPLB placements recompiled for (why, digests)
    delta: Any = None  # executors.delta.DeltaReport of what this process sent (RefitSpec(delta=K)), else None


class TrainerSession:
    """The trainer side of refits into engines: `init` once, `refit` after each training step, `close` at the end.

    Process 0 drives the engines (pause, start, update, finish, resume) and holds a lease on them; every process
    sends its own shards straight to the engine workers that need them.

    Args:
        refit: what the trainer and the engines agree on (replica and digest are filled in per engine).
        process: this trainer process's rank (source rank `process` of the plan).
        tensors: this process's source tensors ({physical name: tensor}, or {source rank: {...}}).
        engines: on process 0, the engines to refit (replica k = engines[k]); other processes pass none.
        trainer_group: a torch.distributed group of the trainer processes, to share process 0's rendezvous.
        rendezvous: an `adapters.rendezvous.Rendezvous`, the same on every process (instead of `trainer_group`):
            process 0 hosts the store at its address (a fixed port), the others wait for it there within its timeout.
        host: the address process 0's store binds to (None: this host's routable address, reshard.addresses).
        pause: vLLM's /pause mode: "wait" drains the requests in flight, "keep" freezes them, "abort" aborts
            them; None: not paused.
        pause_for: "refit" (the engines pause for the whole refit) or "flip" (they generate while the bytes land
            in their staging, `RefitSpec.staging`, and pause only for the install).
        timeout: seconds a refit may take, all its steps together, and any one step of init or close.
        lora_ids: install="lora_slot" with engines that serve the adapter under different ids: engine k's id.
        lease: seconds of the driver's lease on engines that keep one (`engines.Leased`): if process 0 dies or
            freezes, the engine ends the open update within `lease` and serves its previous weights. None: none.

    Raises:
        ArgumentError: an argument of the wrong type or an impossible value (pause_for="flip" without staging, a
            rendezvous at port 0 without trainer_group).
        ExecutionError: a process that is not a source rank of the plan, engines given to another process than
            0, or `lora_ids` that do not fit the engines.
    """

    def __init__(self, refit: RefitSpec, process: int, tensors: RankTensors | dict[str, torch.Tensor], *,
                 engines: Sequence[EngineClient] = (), trainer_group: Any = None, rendezvous: Any = None,
                 host: str | None = None, pause: str | None = "wait", timeout: float = 600.0,
                 lora_ids: Sequence[int] | None = None, lease: float | None = 30.0, pause_for: str = "refit") -> None:
        # each argument refused with ArgumentError naming it
        instance("refit", refit, RefitSpec, "a RefitSpec")
        integer("process", process, 0, 1 << 20)
        # {name: tensor} is this process's source rank: checked as {process: {name: tensor}}
        nested = isinstance(tensors, Mapping) and bool(tensors) and all(isinstance(k, int) for k in tensors)
        self.tensors = tensors if nested else {process: tensors}
        rank_tensors("tensors", self.tensors, deep=True)
        if not isinstance(engines, (list, tuple)):
            raise ArgumentError("engines", engines,
                                "must be a list of engine clients (VllmServer, RayEngineClient ...)")
        for engine in engines:
            if not isinstance(engine, EngineClient):
                missing = [m for m in vars(EngineClient) if m[0] != "_" and not callable(getattr(engine, m, None))]
                raise ArgumentError("engines", engine, f"must be engine clients (adapters.engines.EngineClient); this "
                                    f"one lacks {missing}")
        instance("trainer_group", trainer_group, dist.ProcessGroup, "a torch.distributed ProcessGroup", none=True)
        instance("rendezvous", rendezvous, rv.Rendezvous, "an adapters.rendezvous.Rendezvous", none=True)
        if rendezvous is not None and trainer_group is None and rendezvous.port == 0:
            raise ArgumentError("rendezvous", rendezvous, "needs a fixed port without trainer_group: the other "
                                "processes dial the address they were given, not the one process 0's store binds")
        text("host", host, none=True)
        text("pause", pause, none=True, choices=("wait", "abort", "keep"))
        text("pause_for", pause_for, choices=("refit", "flip"))
        if pause_for == "flip" and refit.staging is None:
            raise ArgumentError("pause_for", pause_for, "needs staged refits: RefitSpec(staging='device' or 'host'); "
                                "without staging the bytes go live as they land, so the engines pause for the refit")
        seconds("timeout", timeout)
        if lora_ids is not None and (not isinstance(lora_ids, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i > 0 for i in lora_ids)):
            raise ArgumentError("lora_ids", lora_ids, "must be a list of positive adapter ids, or None")
        if lease is not None and (isinstance(lease, bool) or not isinstance(lease, (int, float))
                                  or not 1.0 <= lease <= 3600.0):
            raise ArgumentError("lease", lease, "a number of seconds in [1, 3600], or None for no lease")
        self.refit_spec, self.process = refit, process
        self.engines, self.trainer_group, self.pause_mode = list(engines), trainer_group, pause
        self.pause_for = pause_for
        self.given_rendezvous, self.host, self.timeout = rendezvous, host, timeout
        self.rendezvous, self.store, self.version = None, None, 0
        self.hosted: Any = None  # process 0's store at a given rendezvous, kept across inits (_meet)
        self.executor: Executor | None = None
        self.generation = 0  # inits so far: each meets under a refit id of its own
        self.followed: list[dict[str, Any]] = []  # EPLB placements followed (adapters.placement_follow)
        plan = refit.plan()
        if process not in range(plan.src.num_ranks):
            raise ExecutionError(f"process={process} is not a source rank of the plan (0..{plan.src.num_ranks - 1})")
        if self.engines and process != 0:
            raise ExecutionError("only trainer process 0 drives the engines; pass engines on process 0 only")
        self.lease = float(lease) if lease is not None else None
        self.renewal: LeaseRenewal | None = None
        self._winding_down: Any = None  # a refit's clean-up left running in the background (refit)
        self.lora_ids = list(lora_ids) if lora_ids is not None else None
        if self.lora_ids is not None and (refit.install != "lora_slot" or len(self.lora_ids) != len(self.engines)):
            raise ExecutionError(f"lora_ids={self.lora_ids} must give one id per engine ({len(self.engines)}) of an "
                                 f"install='lora_slot' refit (install={refit.install!r})")

    def init(self) -> None:
        """Meet the engines (again, after a failure): every trainer process calls it, before any byte moves.

        Raises:
            LayoutMismatchError: this process's tensors differ from the plan's source tensors.
            ExecutionError: an engine refused the spec or cannot be reached, or the rendezvous failed in time.
        """
        follow(self, self._init, "init")

    def _init(self) -> None:
        # a previous refit's resume must not land inside this init's calls; a new generation makes it skip the rest
        self._await_wind_down(time.monotonic() + self.timeout, None)
        self._close_executor()
        self.store = None
        self.generation += 1
        refit, plan = self.refit_spec, self.refit_spec.plan()
        refit = replace(refit, plan_digest=plan.digest)
        mismatch = self._tensors_mismatch(plan)
        if refit.cross_process:
            refit = replace(refit, rendezvous=self._meet().to_dict())
        elif mismatch is None:
            publish_source(str(refit.options.get("key", "default")), self.tensors)
        self.refit_spec = refit
        ahead: str | None = None
        calls: list[EngineCall] = []
        try:  # every failure fails the rendezvous: the other processes stop there, not at their timeout
            if mismatch is not None:  # refused at init, before any engine is called
                raise ExecutionError(f"trainer process {self.process}: {mismatch}")
            ahead = self._nixl_agent_ahead(refit)
            self._take_lease()
            # an engine that refuses fails the rendezvous at once: no trainer process waits out its timeout
            calls = [EngineCall(engine, "init_weight_transfer_engine", (replace(refit, replica=k, **(
                {"lora_id": self.lora_ids[k]} if self.lora_ids else {})).to_dict(),), self._fail_rendezvous)
                for k, engine in enumerate(self.engines)]
            if refit.cross_process:
                rv.join(self.store, self.rendezvous, self.process, refit.num_processes, "trainer")
                self.executor = open_transport(refit, self.process, self.tensors, {}, store=self.store)
        except ExecutionError as e:
            self._fail_rendezvous(str(e))
            errors = wait_calls(calls, self.timeout)
            raise ExecutionError(f"{e}" + (f"; engines said: {'; '.join(errors)}" if errors else "")) from e
        finally:
            if ahead is not None:  # taken by the executor, or never needed (no NIXL peer)
                from ..executors.nixl.agent import discard_ahead

                discard_ahead(ahead)
        errors = wait_calls(calls, self.timeout)
        if errors:
            self._fail_rendezvous("; ".join(errors))
            raise ExecutionError("refit init failed: " + "; ".join(errors))

    def _tensors_mismatch(self, plan: Any) -> str | None:
        """Why this process's tensors cannot be the plan's source (names, shapes, dtypes, contiguity), or None."""
        from ..executors.reference import check_tensors

        try:
            check_tensors(plan, self.tensors, {})
        except ExecutionError as e:
            return str(e)
        missing = sorted(set(self.tensors) - set(range(plan.src.num_ranks)))
        return f"source ranks {missing} are not ranks of the plan" if missing else None

    def _nixl_agent_ahead(self, refit: RefitSpec) -> str | None:
        """NIXL: this process's agent, made before the lease is taken (its set-up holds the GIL); its name, or None."""
        delay = refit.options.get("progress_delay_us", 1000)
        if refit.transport != "nixl" or isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
            return None  # (a bad delay is refused by the executor's options, with the error naming it)
        from ..executors.nixl.agent import make_agent_ahead

        name = f"{refit.rendezvous['refit_id']}:{self.process}"  # the executor's agent (adapters.refit)
        make_agent_ahead(name, delay)
        return name

    def _take_lease(self) -> None:
        """Process 0: a lease of a new generation on every engine that keeps one, renewed until close."""
        if self.renewal is not None:
            self.renewal.stop()
            self.renewal = None
        if self.lease is not None and any(isinstance(e, Leased) for e in self.engines):
            self.renewal = LeaseRenewal([], uuid.uuid4().hex, self.lease)
            self.renewal.take(self.engines, self.timeout)

    def _meet(self) -> Any:
        """The rendezvous: hosted by process 0, shared over the trainer group (or given to every process)."""
        rdv = self.given_rendezvous
        if rdv is not None:  # the same on every process: a refit id of this init's own, derived alike everywhere
            rdv = replace(rdv, refit_id=f"{rdv.refit_id}g{self.generation}")
        if self.process == 0 and (rdv is None or self.trainer_group is not None):
            rdv, self.store = rv.host_store(rdv or rv.Rendezvous.new(self.host, timeout=min(self.timeout, 300.0)))
        if self.trainer_group is not None:
            rdv = broadcast_json(rdv.to_dict() if self.process == 0 else None, self.trainer_group, self.timeout,
                                  f"trainer process {self.process}: the rendezvous from process 0 over trainer_group")
            rdv = rv.Rendezvous.from_dict(rdv)
        if rdv is None:
            raise ExecutionError("trainer processes other than 0 need the rendezvous: pass trainer_group (it is "
                                 "shared from process 0) or the same `rendezvous` on every process")
        if self.store is None and self.process == 0:
            # kept across inits: a process that begins the next init first finds this store and waits in it for
            # the new refit id's keys, where a store hosted anew at the same address would drop its connection
            self.store = self.hosted = rv.host_store(rdv, self.hosted)[1]
        elif self.store is None:  # shared over trainer_group: hosted already, so an unreachable one fails at once
            self.store = rv.connect(rdv) if self.trainer_group is not None else self._dial(rdv)
        self.rendezvous = rdv
        return rdv

    def _dial(self, rdv: rv.Rendezvous) -> Any:
        """A process other than 0 given the rendezvous: process 0's store, waited for within the rendezvous's
        timeout (nothing orders the processes' inits: this one may come before process 0 hosts it)."""
        stores: list[Any] = []
        failed: list[ExecutionError] = []

        def reached() -> bool:
            try:
                stores.append(rv.connect(rdv))  # refused at once while nothing listens there: tried again
            except ExecutionError as e:
                failed[:] = [e]
            return bool(stores)

        if not poll(reached, time.monotonic() + rdv.timeout, first_s=0.01, most_s=0.25):
            raise ExecutionError(f"trainer process {self.process}: process 0 did not host the given rendezvous "
                                 f"within {rdv.timeout:.0f} s: {failed[-1]}")
        return stores[0]

    def _fail_rendezvous(self, reason: str) -> None:
        if self.store is not None and self.rendezvous is not None:
            rv.fail(self.store, self.rendezvous, f"trainer: {reason}")

    def refit(self, version: str | None = None) -> RefitResult:
        """One refit of every engine: every trainer process calls it, with the same version.

        Bounded by the session's `timeout` from its start; a clean-up the engines have not answered by then goes
        on in the background, and the next `init`, `refit` or `close` waits for it first.

        Args:
            version: the weight version the engines report afterwards (default: a counter).

        Returns:
            What this process did: the version, the phases' wall times and its executor's stats.

        Raises:
            ExecutionError: the refit failed (a dead or frozen peer, a refused update, a checksum mismatch, no
                answer by the deadline); the engines keep their previous weights, and `init` + `refit` works again.
        """
        before = len(self.followed)
        result = follow(self, lambda: self._refit(version), f"refit {version or self.version + 1}")
        result.followed = self.followed[before:]
        return result

    def _refit(self, version: str | None) -> RefitResult:
        deadline = time.monotonic() + self.timeout  # shared by every engine call below
        self._await_wind_down(deadline, "this refit")
        self.version += 1
        version = version or str(self.version)
        info = {"version": version, "refit": (self.refit_spec.rendezvous or {}).get("refit_id", "")}
        driver, flip = bool(self.engines), self.pause_for == "flip" and bool(self.engines)
        paused: list[EngineClient] = []
        calls: list[EngineCall] = []  # the engines' transfer calls, started as this process begins to send
        # the first pause call (perf_counter), the requests the engines held then, this process's executor stats
        self._paused_at, self._in_flight, self._stats = None, None, None
        # (the phase a step ends, or None; the step, returning its errors): run in order while none has failed
        steps = [
            ("start" if driver else None, lambda: self._start(paused, deadline)),
            ("transfer", lambda: self._send(info, calls, deadline)),
            *([("staged", lambda: self._received(calls, deadline) or self._await_staged(deadline)),
               ("pause", lambda: [e for engine in self.engines for e in self._pause(engine, paused, deadline)])]
              if flip else [(None, lambda: self._received(calls, deadline))]),
            ("flip" if flip else "engines", lambda: wait_calls(
                [EngineCall(e, "update_weights", ({**info, "phase": "install"},)) for e in self.engines],
                self.timeout, deadline)),
            ("finish" if driver else None, lambda: [e for engine in self.engines for e in self._bounded(
                engine, "finish_weight_update", version, deadline=deadline)])]
        marks: list[tuple[str, float]] = [("", time.perf_counter())]
        errors: list[str] = []
        landed = False
        try:
            for phase, step in steps:
                errors = step()
                if errors:
                    break
                if phase is not None:
                    marks.append((phase, time.perf_counter()))
            else:
                landed = True
        finally:  # the undo: end what did not land on every engine worker (without a version), resume the paused
            if paused or (driver and not landed):
                errors += self._wind_down(driver and not landed, paused, deadline)
            if paused:
                marks.append(("resume", time.perf_counter()))
        if errors:
            from .vllm.lease import TORN

            kept = "engines keep their previous weights" if not any(TORN in e for e in errors) else \
                f"{TORN} on an engine: it stays fenced (paused, generation refused) until a refit lands whole"
            raise ExecutionError(f"refit {version!r} failed; {kept}: " + "; ".join(errors) + self._members())
        phases = {name: t - marks[i][1] for i, (name, t) in enumerate(marks[1:])}
        stats = self._stats
        if driver:  # the driver: how long generation stopped, and what was in flight meanwhile
            pause_s = marks[-1][1] - self._paused_at if paused and self._paused_at is not None else 0.0
            stats = replace(stats or RefitStats("", self.process, self.version, 0.0), pause_s=pause_s,
                            in_flight=tuple(self._in_flight) if self._in_flight is not None else None)
        return RefitResult(version, marks[-1][1] - marks[0][1], phases, stats,
                           delta=getattr(self.executor, "last_delta", None))

    def _start(self, paused: list[EngineClient], deadline: float) -> list[str]:
        """Pause (pause_for="refit") and start the update on each engine, up to the first error, then agree on the
        engines' placement (adapters.placement_follow): the errors; `paused`: the engines to resume."""
        errors: list[str] = []
        for engine in self.engines:
            errors = self._pause(engine, paused, deadline) if self.pause_for == "refit" else []
            errors = errors or self._bounded(engine, "start_weight_update", deadline=deadline)
            if errors:
                break
        return agree(self, str(self.version), errors, deadline)

    def _pause(self, engine: EngineClient, paused: list[EngineClient], deadline: float) -> list[str]:
        """Pause one engine (when asked and it can), then ask which requests it holds (only "keep" holds any)."""
        if not (self.pause_mode and isinstance(engine, Pausable)):
            return []
        paused.append(engine)
        self._paused_at = self._paused_at or time.perf_counter()
        errors = self._bounded(engine, "pause", self.pause_mode, deadline=deadline)
        if not errors and self.pause_mode != "keep":
            self._in_flight = self._in_flight or []
        elif not errors and isinstance(engine, ReportsInFlight):
            with contextlib.suppress(Exception):  # a report only: an engine without reshard's worker extension
                ids = engine.in_flight()
                self._in_flight = (self._in_flight or []) + list(ids) if ids is not None else self._in_flight
        return errors

    def _send(self, info: dict[str, Any], calls: list[EngineCall], deadline: float) -> list[str]:
        """Start the engines' transfer calls (into `calls`), then send this process's bytes; the errors (if sending
        failed: with the engines' once their calls ended, before the update is closed)."""
        calls += [EngineCall(e, "update_weights", ({**info, "phase": "transfer"},)) for e in self.engines]
        try:  # bounded by the transport's own timeout (executors wait for peers, not engine calls)
            self._stats = self.executor.refit() if self.executor is not None else None
        except ExecutionError as e:
            return [f"trainer process {self.process}: {e}", *self._received(calls, deadline)]
        return []

    def _received(self, calls: list[EngineCall], deadline: float) -> list[str]:
        """The engines' transfer calls joined by `deadline`, and the lease renewal's failure: the errors."""
        errors = wait_calls(calls, self.timeout, deadline)
        return errors + [self.renewal.error] if self.renewal is not None and self.renewal.error else errors

    def _await_staged(self, deadline: float) -> list[str]:
        """pause_for="flip": poll `ReportsStaged` engines until every staged transfer ended, by `deadline`; errors."""
        pending = [e for e in self.engines if isinstance(e, ReportsStaged)]
        errors: list[str] = []

        def landed() -> bool:
            calls = [EngineCall(e, "staged", ()) for e in pending]
            errors.extend(wait_calls(calls, self.timeout, deadline))
            pending[:] = [e for e, c in zip(pending, calls) if c.error is None and c.value is False]
            return bool(errors) or not pending

        if not poll(landed, deadline, first_s=0.005, most_s=0.02):
            errors.append(f"the staged transfer of {pending} did not end by the refit's deadline "
                          f"({self.timeout:.0f} s after it began)")
        return errors

    def _wind_down(self, close: bool, paused: list[EngineClient], deadline: float) -> list[str]:
        """Close a failed update, then resume the paused engines, waited for until `deadline`; the errors."""
        generation, problems = self.generation, []

        def run() -> None:
            if close:  # the workers that did not raise keep the update open; the others' refusals are expected
                wait_calls([EngineCall(e, "finish_weight_update", (None,)) for e in self.engines], self.timeout)
            for engine in paused:
                if self.generation != generation:  # a new init took over: its lease ends what this one left open
                    return
                problems.extend(f"resume failed: {e}" for e in self._bounded(engine, "resume"))

        call = Background(run, name="reshard-wind-down")
        if not call.join(deadline):
            self._winding_down = call
            what = "closing the failed update and resuming" if close else "resuming"
            return [f"{what} the engines did not end by the refit's deadline ({self.timeout:.0f} s after it "
                    f"began); it goes on in the background"]
        return list(problems)

    def _await_wind_down(self, deadline: float, who: str | None) -> None:
        """Wait until `deadline` for a previous refit's wind-down; ExecutionError if it is still running then (`who`:
        the step that cannot start; None: a step that goes on regardless)."""
        call = self._winding_down
        if call is not None and call.join(deadline):
            self._winding_down = None
        elif call is not None and who is not None:
            raise ExecutionError(f"{who} did not start: the previous refit's clean-up (closing its update, resuming "
                                 f"the engines) is still waiting for an engine that does not answer")

    def _members(self) -> str:
        """Who is who in the transport's group (its errors name group ranks), and the fan-out trees."""
        refit = self.refit_spec
        if not refit.cross_process:
            return ""
        plan, dst = refit.plan(), refit.layouts()[1]
        S, tp = plan.src.num_ranks, dst.ranks_per_replica
        engines = ", ".join(f"engine replica {k} = group ranks {S + k * tp}-{S + (k + 1) * tp - 1}"
                            for k in range(dst.num_replicas))
        note = f" (group ranks 0-{S - 1} are trainer processes, {engines}"
        if plan.fanout:
            ratio = max(plan.dst.num_replicas // dst.num_replicas, 1)  # plan replicas per engine (loader: its ranks)
            feeds: dict[int, set[int]] = {}
            for parents in plan.replica_parent:
                for child, parent in enumerate(parents):
                    if parent >= 0 and parent // ratio != child // ratio:
                        feeds.setdefault(parent // ratio, set()).add(child // ratio)
            if feeds:
                edges = "; ".join(f"replica {p} relays to replicas {sorted(c)}" for p, c in sorted(feeds.items()))
                note += f"; fan-out: {edges}: a replica fed through a failed relay keeps its previous weights too"
        return note + ")"

    def _bounded(self, engine: EngineClient, method: str, *args: Any, deadline: float | None = None) -> list[str]:
        """An engine call waited for within the timeout (or until `deadline`), then left to its thread: its errors."""
        return wait_calls([EngineCall(engine, method, args)], self.timeout, deadline)

    def _close_executor(self) -> None:
        """Close the transport, bounded by the timeout."""
        if self.executor is not None:
            close_within(self.executor.close, self.timeout, f"closing trainer process {self.process}'s executor")
            self.executor = None

    def close(self) -> None:
        """Release the engines' lease and close the transport, each bounded by the timeout."""
        self._await_wind_down(time.monotonic() + self.timeout, None)  # the lease's release (or lapse) ends the rest
        if self.renewal is not None:
            self.renewal.release(min(self.timeout, 60.0))
            self.renewal = None
        self._close_executor()
        if not self.refit_spec.cross_process:
            withdraw_source(str(self.refit_spec.options.get("key", "default")))
        self.store = self.hosted = None


__all__ = ["EngineClient", "RefitResult", "TrainerSession"]
