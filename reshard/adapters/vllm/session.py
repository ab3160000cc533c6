"""One vLLM worker's side of a refit (`WorkerSession`), and its steps agreed on by every worker of the engine
(`AgreedSteps`, which vLLM's weight-transfer engine and the worker extension both drive: if any worker fails a step,
none goes on):

    steps = AgreedSteps(model, vllm_config)
    steps.init(lambda: RefitSpec.from_dict(payload))   # every worker binds a WorkerSession; raises before bytes move
    steps.start(); steps.update(); steps.finish()      # one refit: the session's start, transfer, install

A WorkerSession's construction checks the trainer's model and layout against what this worker serves (an EPLB
engine's expert placement again at every `start`), compiles the plan, binds the destination (direct: the live
parameters; loader: buffers for whole tensors; lora_slot: an adapter's slot) and opens the transport; a failure is
reported at the rendezvous (waiting trainers stop at once) and raised. A cross-process set-up does the quick local
steps at once and waits for the other members in a thread, since vLLM runs an init on the engine's RPC path and would
stop generating meanwhile; its failure is raised by the next `start` or `transfer`.

A refit is all or nothing on this engine: the bytes land in the executor's staging or the loader's buffers first.
With `RefitSpec.staging`, `transfer` returns at once and lands while the engine generates; the install (the flip)
first agrees with the other workers that every one has its bytes whole. An install that fails once it began
writing names `lease.TORN`, and the server's lease middleware fences the engine until a refit lands whole.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ...errors import ExecutionError, LayoutError, LayoutMismatchError, PlanError
from ...executors.base import Executor, close_within
from ...executors.checksum import tensor_digests
from ...polling import Background
from ...layouts.lora import VllmLoraLayout, base_spec
from ...layouts.math_config import math_config, math_differences, math_fingerprint
from .. import rendezvous as rv
from ..lora.slots import AdapterSlot, lora_manager
from ..refit import RefitSpec, open_transport
from .derive import representative_layers
from .direct import bind_direct
from .experts import check_loader_placement, check_placement, live_placement
from .lease import TORN
from .live import declared_layout, local_rank, spec_of
from .loader import LoaderInstaller
from .staging import Shadow, Staging, check_room, free_bytes, swaps

MESSAGE_BYTES = 4096  # per worker, when the workers of an engine tell each other why a step failed
AGREE_TIMEOUT = 300.0  # seconds a worker waits for the others of its engine to agree (the refit's timeout once bound)
log = logging.getLogger("reshard.vllm")


class WorkerSession:
    """One worker's side of one refit (see the module docstring).

    Args:
        model: the worker's model.
        vllm_config: the worker's vLLM config.
        refit: the trainer's init payload, parsed.

    Raises:
        LayoutMismatchError, LayoutError, PlanError: the trainer's model, layout or plan is not this worker's.
        ExecutionError: the store cannot be reached, the secret is wrong, this worker's place is taken, or (in-process
            transports) the transport failed.
    """

    def __init__(self, model: torch.nn.Module, vllm_config: Any, refit: RefitSpec) -> None:
        self.model, self.vllm_config, self.refit = model, vllm_config, refit
        self.executor: Executor | None = None
        self.store = None
        self.rendezvous = None
        self.meeting: Background | None = None  # the background set-up
        self.meeting_deadline = 0.0  # monotonic: when its own bounded steps are over
        self.closed = False
        self.lock = threading.Lock()  # between the background set-up and close()
        try:
            self._set_up()
        except Exception as e:
            self._report(e)
            self.close()
            raise

    def _set_up(self) -> None:
        refit = self.refit
        if refit.cross_process:
            self.rendezvous = rv.Rendezvous.from_dict(refit.rendezvous)
        src, dst = refit.layouts()
        check_served_model(refit, dst, self.vllm_config)
        self.dst = dst
        self._check_experts()
        self.plan = refit.agreed_plan()
        self.rank = local_rank(self.vllm_config, refit.replica)
        if not 0 <= self.rank < dst.num_ranks:
            raise LayoutError(dst.engine, f"this worker is rank {self.rank} of the destination, which has "
                                        f"{dst.num_ranks} ranks (check replica and replicas)")
        self.shadow: Shadow | None = None  # a staged loader install on a CPU engine
        self.landing: Background | None = None  # a staged transfer running while the engine generates
        self.flip_s = 0.0  # the last install's wall time
        self.tail_s = 0.0  # how long the last install waited for its staged transfer
        # whatever the install, the destination is the tensors the transport writes, the checks `start` runs on
        # what they are bound to, and the steps of the flip
        if refit.install == "lora_slot":
            slot = AdapterSlot(lora_manager(self.model), dst, refit.lora_id, self.rank)
            tensors, self.checks, self.flips = slot.tensors, [slot.verify], [slot.scale]
        elif refit.install == "direct":
            layers = refit.verify_layers if refit.verify_layers is not None else representative_layers(dst.model)
            binding = bind_direct(self.model, dst, self.rank, layers, self.vllm_config)
            tensors, self.checks, self.flips = binding.tensors, [binding.verify], [binding.finish]
            if refit.staging is not None:  # the transport writes the staging; the flip copies it into the model
                staging = Staging(tensors, refit.staging, f"one copy of engine replica {refit.replica} rank "
                                                          f"{self.rank}'s shard, {len(tensors)} tensors")
                tensors, self.flips = staging.tensors, [staging.flip, binding.finish]
        else:
            installer = self.installer = LoaderInstaller(self.model, self.rank, self.plan, self.vllm_config,
                                                         shared=refit.transport == "shared")
            tensors, self.checks, self.flips = installer.buffers, [], [installer.install]
            if refit.staging is not None and swaps(self.model, installer.device, self.vllm_config):
                self.shadow = Shadow(installer)  # loaded and processed off the pause, swapped at the flip
                check_room(self.shadow.nbytes, free_bytes(installer.device, "host"), refit.staging,
                           f"a shadow of engine replica {refit.replica} rank {self.rank}'s processed layers")
                self.flips = [self.shadow.swap]
        self.tensors, self.installed = tensors, False
        if not refit.cross_process:
            self.executor = open_transport(refit, self.rank, {}, {self.rank: tensors})
            return
        self.store = rv.connect(self.rendezvous)  # one probe first: an unreachable address fails at once
        process = self.plan.src.num_ranks + self.rank
        rv.check_secret(self.store, self.rendezvous, "engine", process)  # a wrong secret: at once
        rv.check_place(self.store, self.rendezvous, process)  # a duplicate rank: at once
        self.meeting_deadline = time.monotonic() + self.rendezvous.timeout + 30.0 + self._timeout()
        self.meeting = _on_this_device(self._meet, process, tensors, name="reshard-meet")

    def _meet(self, process: int, tensors: Any) -> None:
        """The background set-up: join, then open the transport; a failure is reported at the rendezvous; a session
        closed meanwhile releases what was opened."""
        store, rdv, refit = self.store, self.rendezvous, self.refit
        try:
            rv.join(store, rdv, process, refit.num_processes, "engine")
            executor = open_transport(refit, process, {}, {self.rank: tensors}, store=store)
        except BaseException as e:  # kept by the Background for start / transfer
            if not self.closed:
                self._report(e, store)
            raise
        with self.lock:
            if not self.closed:
                self.executor = executor
                return
        close_within(executor.close, self._timeout(), "closing a superseded refit's executor")

    def _timeout(self) -> float:
        return transport_timeout(self.refit.options, getattr(self.rendezvous, "timeout", None))

    def ready(self) -> None:
        """Wait for the background set-up (bounded) and raise its failure."""
        meeting = self.meeting
        if meeting is None:
            return
        if not meeting.join(self.meeting_deadline):
            raise ExecutionError(f"refit {self.rendezvous.refit_id}: this worker's set-up (the rendezvous and "
                                 f"the transport) did not end by its deadline")
        if meeting.error is not None:
            e = meeting.error
            raise ExecutionError(f"the refit's set-up failed on this worker (engine replica {self.refit.replica}): "
                                 f"{type(e).__name__}: {e}") from None

    def _report(self, error: BaseException, store: Any = None) -> None:
        """Tell the trainer processes waiting at the rendezvous why this worker cannot take part."""
        reason = f"engine replica {self.refit.replica} worker: {type(error).__name__}: {error}"
        if self.rendezvous is None:
            return
        store = store if store is not None else self.store
        with contextlib.suppress(Exception):  # the store may be unreachable; the error raised says what failed
            rv.fail(store if store is not None else rv.connect(self.rendezvous), self.rendezvous, reason)

    def _check_experts(self) -> None:
        """The plan's expert placement must be what the EPLB state holds now (loader: the initial one)."""
        if self.dst.experts is None:
            return
        live = live_placement(self.model, self.dst.tp)
        where = f"engine replica {self.refit.replica}"
        if self.refit.install == "loader":
            check_loader_placement(live, where)
        else:
            check_placement(self.dst, live, where, self.refit, self.store)  # reported to the trainers

    def check_refit(self, refit: str) -> None:
        """Refuse an update of another refit (an old driver's late message)."""
        ours = (self.refit.rendezvous or {}).get("refit_id", "")
        if refit and refit != ours:
            raise PlanError(f"an update of refit {refit[:16]!r} refused: this worker is bound to refit {ours[:16]!r} "
                            f"(a late message of an old generation is never applied)")

    def start(self) -> None:
        """Open an update: the set-up ended, the expert placement, the bound parameters or slot unchanged."""
        self.ready()
        self.received = False
        self._check_experts()
        for check in self.checks:
            check()

    def transfer(self) -> None:
        """This worker's part of the transfer, the model untouched; staged refits return at once."""
        self.ready()
        if self.executor is None:
            raise ExecutionError("this refit session is closed")
        if self.landing is not None and self.landing.thread.is_alive():
            raise ExecutionError("a staged transfer of an earlier update is still running on this worker")
        self.received = self.installed = False
        self.landing = None
        if self.refit.staging is None:
            return self._land()
        self.landing = _on_this_device(self._land, name="reshard-stage")

    def _land(self) -> None:
        try:
            self.executor.refit()
            if self.shadow is not None:
                self.shadow.build()
        except Exception as e:
            self._report(e)
            raise
        self.received = True

    def staged(self) -> dict[str, Any]:
        """Whether this worker's staged transfer has ended, without waiting: {"done": bool, "error": text or None}."""
        landing = self.landing
        if landing is not None and landing.thread.is_alive():
            return {"done": False, "error": None}
        error = landing.error if landing is not None else None
        return {"done": True, "error": f"{type(error).__name__}: {error}" if error is not None else None}

    def _landed_whole(self) -> None:
        """Staged refits: wait for the transfer, then agree with the other workers that all bytes are whole."""
        landing, start = self.landing, time.perf_counter()
        if landing is None:
            return
        self.landing = None

        def whole() -> None:
            timeout = self._timeout()
            if not landing.join(time.monotonic() + timeout):
                raise ExecutionError(f"the staged transfer did not end within {timeout:.0f} s")
            if landing.error is not None:
                raise ExecutionError(f"the staged transfer failed: {type(landing.error).__name__}: {landing.error}")

        ok = agreed("staged transfer", whole)
        self.tail_s = time.perf_counter() - start
        if not ok:
            raise ExecutionError("another worker of this engine lacks its staged bytes")

    def install(self) -> None:
        """After every worker has its bytes: the flip (direct, shadow), load_weights (loader) or B *= alpha / r;
        refused unless this update's transfer landed whole (the install step of a two-phase update, or of one)."""
        try:
            self._landed_whole()
        except ExecutionError as e:
            raise ExecutionError(f"install refused, the live weights untouched: {e}") from None
        if not getattr(self, "received", False):
            raise ExecutionError("install refused: no complete transfer of this update landed on this worker (the "
                                 "flip needs a whole version); the live weights are untouched")
        self.received = False
        start = time.perf_counter()
        try:  # from here the live weights change: a failure leaves a mix, which the server fences
            _injected_flip_fault(self.rank, wrote=False)
            for step in self.flips:
                step()
            _injected_flip_fault(self.rank, wrote=True)
        except Exception as e:
            raise ExecutionError(f"{TORN} on engine replica {self.refit.replica} rank {self.rank}: "
                                 f"{type(e).__name__}: {e}") from None
        self.flip_s = time.perf_counter() - start
        self.installed = True

    def landed(self) -> dict[str, Any]:
        """SHA-256 of each destination tensor the last transfer landed here (before vLLM repacks anything) and
        whether it was installed: {"rank", "refit", "installed", "digests"}."""
        if self.refit.install == "lora_slot" and self.installed:
            raise ExecutionError("an installed adapter slot holds B * alpha / r, not what landed")
        return {"rank": self.rank, "refit": (self.refit.rendezvous or {}).get("refit_id", ""),
                "installed": self.installed, "digests": tensor_digests(getattr(self, "tensors", {}))}

    def close(self) -> None:
        """Close the transport (bounded by its timeout) and release the buffers; a set-up still running is stopped."""
        with self.lock:
            self.closed = True
            executor, self.executor = self.executor, None
        meeting = self.meeting
        if meeting is not None and meeting.thread.is_alive() and self.store is not None:
            # the other members stop with it instead of waiting out the rendezvous's timeout
            rv.fail(self.store, self.rendezvous, f"engine replica {self.refit.replica} worker: the refit was "
                                                 f"superseded (a new init, or shutdown) before every member joined")
        if executor is not None:
            close_within(executor.close, self._timeout(), "closing this worker's executor")
        installer = getattr(self, "installer", None)  # absent when set-up failed before binding
        if installer is not None:
            installer.close()
        self.store = None


def _on_this_device(fn: Any, *args: Any, name: str) -> Background:
    """`fn(*args)` in a Background on this thread's CUDA device (the device is per thread: NCCL groups and copies
    must use this worker's)."""
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def run() -> None:
        if device is not None:
            torch.cuda.set_device(device)
        fn(*args)

    return Background(run, name=name)


def _injected_flip_fault(rank: int, wrote: bool) -> None:
    """Tests only: $RESHARD_TEST_FLIP_FAULT names a file; "<rank>" there fails this rank's flip before it writes,
    "<rank> kill" SIGKILLs the worker after its flip wrote. Read at each flip."""
    path = os.environ.get("RESHARD_TEST_FLIP_FAULT")
    armed = Path(path).read_text().split() if path and os.path.exists(path) else []
    if armed == [str(rank)] and not wrote:
        raise ExecutionError(f"injected flip fault (RESHARD_TEST_FLIP_FAULT) on rank {rank}")
    if armed == [str(rank), "kill"] and wrote:
        os.kill(os.getpid(), signal.SIGKILL)


def transport_timeout(options: dict[str, Any], default: Any) -> float:
    """The transport's timeout from a refit's options, else `default`, else 300 s."""
    return next((float(v) for v in (options.get("timeout"), default)
                 if not isinstance(v, bool) and isinstance(v, (int, float)) and v > 0), 300.0)


def check_served_model(refit: RefitSpec, dst: Any, vllm_config: Any) -> None:
    """The trainer's model and layout must be what the engine serves: the same spec (an adapter's base), the same
    math (`refit.math`, unless the trainer sent none) and the same parallel layout.

    Raises:
        LayoutMismatchError: naming what differs, before any byte moves.
    """
    live = spec_of(vllm_config)
    model = base_spec(dst.model) if isinstance(dst, VllmLoraLayout) else dst.model
    ours = model.model_copy(update={"dtype": live.dtype})
    if ours != live:
        raise LayoutMismatchError(str(dst), [f"trainer: {model}", f"vLLM: {live}"], where="the vLLM model")
    if refit.math is not None:
        engine = math_config(vllm_config.model_config.hf_config.to_dict())
        differ = math_differences(refit.math, engine)
        if differ:
            mine, theirs = math_fingerprint(refit.math)[:12], math_fingerprint(engine)[:12]
            raise LayoutMismatchError(str(dst), [f"the trainer's model config (math {mine}) vs this engine's "
                                                 f"(math {theirs}): " + "; ".join(differ)],
                                      fix="serve the trainer's config, or refit from a spec of the engine's "
                                          "(RefitSpec.of(..., math=None) skips this check)",
                                      where="the vLLM model's config")
    declared = declared_layout(model, vllm_config, dst.replicas)
    # the LoRA settings are AdapterSlot's to check; the expert placement is the EPLB state's (_check_experts)
    lora = {"model", "max_lora_rank", "fully_sharded", "expert_placement"}
    mine, theirs = dst.model_dump(exclude=lora), declared.model_dump(exclude={"model"})
    if mine != theirs:
        differ = ", ".join(f"{k}: {mine[k]!r} vs {theirs[k]!r}" for k in mine if mine[k] != theirs.get(k))
        raise LayoutMismatchError(str(dst), [f"trainer declared {dst}, the engine runs {declared} ({differ})"],
                                  where="this vLLM engine's parallel config")


def _engine_group() -> Any:
    """The CPU (gloo) group of every worker of this engine, or None for a single worker."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        group = get_world_group()
    except Exception:  # noqa: BLE001 - not initialized (a bare model in tests): one worker
        return None
    return group.cpu_group if group.world_size > 1 else None


def agreed(step: str, fn: Callable[[], None], timeout: float = AGREE_TIMEOUT, group: Any = None) -> bool:
    """Run `fn` on every worker of this engine and agree on the outcome: True if it succeeded everywhere. Otherwise
    the last worker raises ExecutionError naming every worker's error and the others return False (vLLM's executor
    stops reading answers at the first failure, so a failure on any earlier worker would mix up later calls).
    Waits at most `timeout` seconds for the other workers."""
    from datetime import timedelta

    import torch.distributed as dist

    error = None
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - agreed on below, then raised on the last worker
        error = f"{type(e).__name__}: {e}"
    group = group if group is not None else _engine_group()  # `group`: tests give their own
    if group is None:
        if error is not None:
            raise ExecutionError(f"{step} failed: {error}")
        return True
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    mine = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
    if error is not None:
        data = error.encode()[:MESSAGE_BYTES - 1] or b"?"
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.zeros_like(mine) for _ in range(size)]
    work = dist.all_gather(gathered, mine, group=group, async_op=True)
    try:
        work.wait(timedelta(seconds=timeout))
    except Exception as e:  # noqa: BLE001 - another worker of this engine never came to the agreement
        raise ExecutionError(f"{step}: the other workers of this engine did not agree within {timeout:.0f} s "
                             f"({e}); this worker's own outcome: {error or 'ok'}") from None
    errors = [(r, bytes(t[t.nonzero().flatten()].tolist()).decode(errors="replace"))
              for r, t in enumerate(gathered) if bool(t.any())]
    if not errors:
        return True
    text = "; ".join(f"worker {r}: {m}" for r, m in errors)
    if rank == size - 1:
        raise ExecutionError(f"{step} failed on this engine: {text}")
    log.warning("reshard %s failed on this engine (reported by its last worker): %s", step, text)
    return False


class AgreedSteps:
    """One worker's refit steps, each agreed on by every worker of its engine (see `agreed`)."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any) -> None:
        self.model, self.vllm_config = model, vllm_config
        self.session: WorkerSession | None = None

    def init(self, refit: Callable[[], RefitSpec], check: Callable[[RefitSpec], None] | None = None) -> None:
        """Bind this worker to the refit `refit()` returns (after the caller's `check`), agreed on; the rest of the
        set-up goes on in the background and `start` agrees on its outcome."""
        self.close()

        def init() -> None:
            spec = refit()
            if check is not None:
                check(spec)
            self.session = WorkerSession(self.model, self.vllm_config, spec)

        if not agreed("init", init) and self.session is not None:
            self.close()  # another worker of this engine failed: none of them takes part

    def active(self) -> WorkerSession:
        """The bound session (RuntimeError before init)."""
        if self.session is None:
            raise RuntimeError("reshard weight transfer is not initialized: init it first")
        return self.session

    def _timeout(self) -> float:
        if self.session is None:
            return AGREE_TIMEOUT
        # another worker may still be inside its own step, bounded by the transport's timeout
        return 2 * transport_timeout(self.session.refit.options, AGREE_TIMEOUT) + 30.0

    def start(self) -> None:
        """Open an update on every worker, agreed on (the background set-up's outcome too)."""
        agreed("start", lambda: self.active().start(), self._timeout())

    def update(self, error: Exception | None = None, phase: str = "all", refit: str = "") -> None:
        """The transfer on every worker, agreed on, and only then the install. `phase`: "transfer" stops before the
        install, "install" installs what this update's transfer received, "all" does both. `refit`: the refit id
        the update belongs to (another is refused). `error`: the update's info was invalid (raised inside the
        agreement)."""

        def transfer() -> None:
            if error is not None:
                raise error
            self.active().check_refit(refit)
            if phase == "install":
                self.active().install()
            else:
                self.active().transfer()

        if agreed("update", transfer, self._timeout()) and phase == "all":
            agreed("install", lambda: self.active().install(), self._timeout())
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def finish(self) -> None:
        """Close the update on this worker (nothing left to do once bound: the install committed it)."""
        self.active()

    def close(self) -> None:
        """Close the session (its transport), if any."""
        if self.session is not None:
            self.session.close()
            self.session = None
