"""One vLLM worker's side of a refit, however vLLM drives it (the weight-transfer engine and the worker
extension both wrap this).

    session = WorkerSession(model, vllm_config, RefitSpec.from_dict(payload))  # checks; raises before bytes move
    session.start(); session.receive(); session.finish()                        # one refit
    session.close()

Construction (vLLM's `init_weight_transfer_engine`): the trainer's model and the engine's layout must be what this
worker serves (an EPLB engine's expert placement: what its EPLB state holds now, checked again at every `start`,
since EPLB may rebalance between refits; experts.py); the plan is compiled (once per process for these layouts)
and its digest compared with the trainer's; the destination is bound -- direct: the live parameters, after checking the model's structure, its
loaders' placements and that nothing was re-laid out; loader: buffers for whole canonical tensors -- and the
transport is opened (cross-process transports: this worker joins the rendezvous as process S + its rank). A
failure anywhere is reported at the rendezvous, so trainer processes waiting there stop at once, and raised.

Cross-process set-up in the background (`background=True`, what the weight-transfer engine and the worker extension
use): vLLM runs an init on the engine's RPC path, where it blocks the engine's scheduler, so a server whose init
waits for members that never come answers /health but no completion until the wait ends. Such an init does what
is quick and local at once -- the checks above, the destination, reaching the store (an unreachable address fails
here, named), the secret, this worker's place -- and returns; waiting for the other members and opening the
transport go on in a thread of their own while the engine keeps generating with its current weights. A failure
there is reported at the rendezvous (the trainer's init raises with it) and raised by the next step that needs
the transport (`start`, `transfer`), which waits for the set-up at most as long as the set-up's own bounded steps.

A refit (`start`, `receive` inside vLLM's `update_weights`, `finish`) is all or nothing on this engine: direct
refits are staged by the executor and commit only once every process has every byte; loader refits receive the
whole model into the buffers first and only then hand them to the model's weight loaders (inside vLLM's
layerwise reload), so a transport failure never touches the model.

Staged refits (`RefitSpec.staging`, adapters.vllm.staging): `transfer` starts this worker's transfer on a thread
of its own and returns at once, so vLLM's engine loop (which runs every weight-update call on its own thread,
between generation steps) goes on generating while the bytes land in the staging (direct) or the buffers
(loader); the install (the flip) first agrees with the engine's other workers that every one has its bytes whole,
then copies them into the live weights (direct) or loads them (loader). An install that fails once it began
writing says so (`lease.TORN`): the server's lease middleware then fences the engine until a refit lands whole.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ...errors import ExecutionError, LayoutError, LayoutMismatchError, PlanError
from ...executors.base import Executor
from ...polling import Background
from ...layouts.lora import VllmLoraLayout, base_spec
from ..lora.slots import AdapterSlot, lora_manager
from ..refit import RefitSpec, open_transport
from .derive import representative_layers
from .direct import DirectBinding, bind_direct
from .experts import check_loader_placement, check_placement, live_placement
from .lease import TORN
from .live import declared_layout, local_rank, spec_of
from .loader import LoaderInstaller
from .shadow import Shadow, swaps
from .staging import Staging, check_room, free_bytes


class WorkerSession:
    """One worker's side of one refit (see the module docstring).

    Args:
        model: the worker's model.
        vllm_config: the worker's vLLM config.
        refit: the trainer's init payload, parsed.
        group: the engine's world group ("colocated" transport).
        background: cross-process transports: wait for the other members and open the transport in a thread
            (the constructor returns once the local checks passed and this worker holds its place); `start` and
            `transfer` wait for it and raise its failure.

    Raises:
        LayoutMismatchError, LayoutError, PlanError: the trainer's model, layout or plan is not this worker's.
        ExecutionError: the store cannot be reached, the secret is wrong, this worker's place is taken, or (not in
            the background) the rendezvous or the transport failed.
    """

    def __init__(self, model: torch.nn.Module, vllm_config: Any, refit: RefitSpec, *, group: Any = None,
                 background: bool = False) -> None:
        self.model, self.vllm_config, self.refit = model, vllm_config, refit
        self.executor: Executor | None = None
        self.store = None
        self.rendezvous = None
        self.meeting: Background | None = None  # the background set-up (its error: why it failed)
        self.meeting_deadline = 0.0  # monotonic: when the background set-up's own bounded steps are over
        self.closed = False
        self.lock = threading.Lock()  # between the background set-up and close()
        try:
            self._set_up(group, background)
        except Exception as e:
            self._report(f"engine replica {refit.replica} worker: {type(e).__name__}: {e}")
            self.close()
            raise

    def _set_up(self, group: Any, background: bool = False) -> None:
        refit = self.refit
        src, dst = refit.layouts()
        check_served_model(refit, dst, self.vllm_config)
        self.dst = dst
        self._check_experts()
        self.plan = refit.agreed_plan()
        self.rank = local_rank(self.vllm_config, refit.replica)
        if not 0 <= self.rank < dst.num_ranks:
            raise LayoutError(dst.engine, f"this worker is rank {self.rank} of the destination, which has "
                                        f"{dst.num_ranks} ranks (check replica and replicas)")
        self.binding: DirectBinding | None = None
        self.installer: LoaderInstaller | None = None
        self.staging: Staging | None = None
        self.shadow: Shadow | None = None  # a staged loader install on a CPU engine (adapters.vllm.shadow)
        self.landing: Background | None = None  # a staged transfer running while the engine generates
        self.flip_s = 0.0  # the last install's wall time (the flip, when staged)
        self.tail_s = 0.0  # how long the last install waited for its staged transfer to end (and agreed on it)
        self.slot: AdapterSlot | None = None
        if refit.install == "lora_slot":
            self.slot = AdapterSlot(lora_manager(self.model), dst, refit.lora_id, self.rank)
            tensors = self.slot.tensors
        elif refit.install == "direct":
            layers = refit.verify_layers if refit.verify_layers is not None else representative_layers(dst.model)
            self.binding = bind_direct(self.model, dst, self.rank, layers, self.vllm_config)
            tensors = self.binding.tensors
            if refit.staging is not None:  # the transport writes the staging; the flip copies it into the model
                self.staging = Staging(tensors, refit.staging, f"one copy of engine replica {refit.replica} rank "
                                                               f"{self.rank}'s shard, {len(tensors)} tensors")
                tensors = self.staging.tensors
        else:
            self.installer = LoaderInstaller(self.model, self.rank, self.plan, self.vllm_config,
                                             shared=refit.transport == "shared")
            tensors = self.installer.buffers
            if refit.staging is not None and swaps(self.model, self.installer.device, self.vllm_config):
                self.shadow = Shadow(self.installer)  # loaded and processed off the pause, swapped at the flip
                check_room(self.shadow.nbytes, free_bytes(self.installer.device, "host"), refit.staging,
                           f"a shadow of engine replica {refit.replica} rank {self.rank}'s processed layers")
        process = self.rank
        self.tensors, self.installed = tensors, False
        if refit.cross_process:
            from .. import rendezvous as rv

            self.rendezvous = rv.Rendezvous.from_dict(refit.rendezvous)
            self.store = rv.connect(self.rendezvous)  # one probe first: an unreachable address fails at once
            process = self.plan.src.num_ranks + self.rank
            if background:
                rv.check_secret(self.store, self.rendezvous, "engine", process)  # a wrong secret: at once
                rv.check_place(self.store, self.rendezvous, process)  # a duplicate rank: at once
                # join waits at most the rendezvous's timeout, the transport's set-up at most its own
                self.meeting_deadline = time.monotonic() + self.rendezvous.timeout + 30.0 \
                    + transport_timeout(refit.options, self.rendezvous.timeout)
                # the CUDA device is per thread: the set-up thread makes NCCL groups on this worker's device
                device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
                self.meeting = Background(self._meet, process, tensors, group, device, name="reshard-meet")
                return
            rv.join(self.store, self.rendezvous, process, refit.num_processes, "engine")
        self.executor = open_transport(refit, process, {}, {self.rank: tensors}, store=self.store, group=group)

    def _meet(self, process: int, tensors: Any, group: Any, device: int | None = None) -> None:
        """The background set-up: wait for every member, then open the transport (on `device`, the worker's CUDA
        device, current in the thread that started it). A failure is kept for the next step and reported at the
        rendezvous; a session closed meanwhile releases what was opened."""
        from .. import rendezvous as rv

        if device is not None:
            torch.cuda.set_device(device)
        store, rdv, refit = self.store, self.rendezvous, self.refit
        try:
            rv.join(store, rdv, process, refit.num_processes, "engine")
            executor = open_transport(refit, process, {}, {self.rank: tensors}, store=store, group=group)
        except BaseException as e:  # kept by the Background for start / transfer, and told to the trainer now
            if not self.closed:
                self._report(f"engine replica {refit.replica} worker: {type(e).__name__}: {e}", store)
            raise
        with self.lock:
            if not self.closed:
                self.executor = executor
                return
        from ...executors.base import close_within

        close_within(executor.close, transport_timeout(refit.options, rdv.timeout),
                     "closing a superseded refit's executor")

    def ready(self) -> None:
        """Wait for the background set-up (at most as long as its own bounded steps) and raise its failure."""
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

    def _report(self, reason: str, store: Any = None) -> None:
        """Tell the trainer processes waiting at the rendezvous why this worker cannot take part."""
        if not self.refit.cross_process or self.refit.rendezvous is None:
            return
        try:
            from .. import rendezvous as rv

            rdv = rv.Rendezvous.from_dict(self.refit.rendezvous)
            store = store if store is not None else self.store
            rv.fail(store if store is not None else rv.connect(rdv), rdv, reason)
        except Exception:  # noqa: BLE001 - the store may be unreachable; the error raised says what failed
            pass

    def _check_experts(self) -> None:
        """The plan's expert placement must be the one this engine's EPLB state holds now; a loader install needs
        vLLM's initial placement (its load_weights writes by it). Read from the model each time: a rebalance may
        come between init and any refit."""
        if self.dst.experts is None:  # no expert parallelism: nothing EPLB moves
            return
        live = live_placement(self.model, self.dst.tp)
        where = f"engine replica {self.refit.replica}"
        if self.refit.install == "loader":
            check_loader_placement(live, where)
        else:
            check_placement(self.dst, live, where, self.refit, self.store)  # reported to the trainers

    # --- one refit ---------------------------------------------------------------------------------
    def check_refit(self, refit: str) -> None:
        """An update of another refit (an old driver's late message, after a new init) is refused."""
        ours = (self.refit.rendezvous or {}).get("refit_id", "")
        if refit and refit != ours:
            raise PlanError(f"an update of refit {refit[:16]!r} refused: this worker is bound to refit {ours[:16]!r} "
                            f"(a late message of an old generation is never applied)")

    def start(self) -> None:
        """Open an update: the set-up ended, the expert placement, the bound parameters or slot unchanged."""
        self.ready()
        self.received = False
        self._check_experts()  # before any byte lands: EPLB may have moved experts since the plan was bound
        if self.binding is not None:
            self.binding.verify()
        if self.slot is not None:
            self.slot.verify()

    def transfer(self) -> None:
        """This worker's part of the transfer; the model is not touched (staged, or the loader's buffers). Staged
        refits (`RefitSpec.staging`): started on a thread of its own, returning at once (the install waits)."""
        self.ready()
        if self.executor is None:
            raise ExecutionError("this refit session is closed")
        if self.landing is not None and self.landing.thread.is_alive():
            raise ExecutionError("a staged transfer of an earlier update is still running on this worker")
        self.received = self.installed = False
        self.landing = None
        if self.refit.staging is None:
            return self._land()
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        self.landing = Background(self._land, device, name="reshard-stage")

    def _land(self, device: int | None = None) -> None:
        if device is not None:  # the staging thread moves bytes on the worker's device
            torch.cuda.set_device(device)
        try:
            self.executor.refit()
            if self.shadow is not None:  # vLLM's load and processing, while the engine still generates
                self.shadow.build()
        except Exception as e:
            self._report(f"engine replica {self.refit.replica} rank {self.rank}: {e}")
            raise
        self.received = True

    def staged(self) -> dict[str, Any]:
        """Whether this worker's staged transfer has ended, without waiting for it (a driver polls it before the
        pause for a flip: a worker call blocks vLLM's engine loop): {"done": bool, "error": its text or None}."""
        landing = self.landing
        if landing is not None and landing.thread.is_alive():
            return {"done": False, "error": None}
        error = landing.error if landing is not None else None
        return {"done": True, "error": f"{type(error).__name__}: {error}" if error is not None else None}

    def _landed_whole(self) -> None:
        """Staged refits: wait for the transfer (as long as the transport's timeout), then agree with the engine's
        other workers that every one has its bytes whole, before any flips. Raises ExecutionError otherwise."""
        landing, start = self.landing, time.perf_counter()
        if landing is None:
            return
        self.landing = None

        def whole() -> None:
            timeout = transport_timeout(self.refit.options, (self.refit.rendezvous or {}).get("timeout"))
            if not landing.join(time.monotonic() + timeout):
                raise ExecutionError(f"the staged transfer did not end within {timeout:.0f} s")
            if landing.error is not None:
                raise ExecutionError(f"the staged transfer failed: {type(landing.error).__name__}: {landing.error}")

        from .agreed import agreed  # (agreed drives this session)

        ok = agreed("staged transfer", whole)
        self.tail_s = time.perf_counter() - start
        if not ok:
            raise ExecutionError("another worker of this engine lacks its staged bytes")

    def install_received(self) -> None:
        """The install step of a two-phase update: only after this update's transfer landed whole (staged: the
        flip, refused for an incomplete version with the live weights untouched)."""
        try:
            self._landed_whole()
        except ExecutionError as e:
            raise ExecutionError(f"install refused, the live weights untouched: {e}") from None
        if not getattr(self, "received", False):
            raise ExecutionError("install refused: no complete transfer of this update landed on this worker (the "
                                 "flip needs a whole version); the live weights are untouched")
        self.received = False
        self.install()

    def install(self) -> None:
        """After every worker has its bytes: direct: the flip when staged, then finish (padding, widened tensors);
        loader: load_weights; lora_slot: B *= alpha / r."""
        self._landed_whole()
        start = time.perf_counter()  # (the wait above is tail_s)
        try:  # from here the live weights change: a failure leaves a mix, which the server fences (lease.TORN)
            _injected_flip_fault(self.rank, wrote=False)
            if self.slot is not None:
                self.slot.scale()
            elif self.binding is not None:
                if self.staging is not None:
                    self.staging.flip()
                self.binding.finish()
            elif self.shadow is not None:
                self.shadow.swap()
            else:
                self.installer.install()
            _injected_flip_fault(self.rank, wrote=True)
        except Exception as e:
            raise ExecutionError(f"{TORN} on engine replica {self.refit.replica} rank {self.rank}: "
                                 f"{type(e).__name__}: {e}") from None
        self.flip_s = time.perf_counter() - start
        self.installed = True

    def landed(self) -> dict[str, Any]:
        """reshard's own end-to-end digest of what the last transfer landed on this worker, before vLLM's loaders
        repack anything: SHA-256 of each destination tensor of the plan (loader: the whole canonical tensors, so
        they compare with a checkpoint's; direct: the parameters written; lora_slot: before B's scaling) and
        whether it was installed. vLLM's /weight_checker hashes parameters after its processing, and on the CPU
        build hashes repacked parameters as empty input."""
        from ...executors.checksum import tensor_digests

        if self.slot is not None and self.installed:
            raise ExecutionError("an installed adapter slot holds B * alpha / r, not what landed")
        return {"rank": self.rank, "refit": (self.refit.rendezvous or {}).get("refit_id", ""),
                "installed": self.installed, "digests": tensor_digests(getattr(self, "tensors", {}))}

    def receive(self) -> None:
        """transfer, then install (a one-phase update)."""
        self.transfer()
        self.install()

    def finish(self) -> None:
        """Close the update (nothing left to do: install committed it)."""
        pass

    def close(self) -> None:
        """Close the transport (bounded by its timeout) and release the buffers; a set-up still running is stopped."""
        with self.lock:  # a background set-up still running releases what it opens itself (_meet)
            self.closed = True
            executor, self.executor = self.executor, None
        meeting = self.meeting
        if meeting is not None and meeting.thread.is_alive() and self.store is not None:
            # its join stops at its next look at the store (a new init or shutdown superseded this refit); the
            # other members stop with it instead of waiting out the rendezvous's timeout
            from .. import rendezvous as rv

            rv.fail(self.store, self.rendezvous, f"engine replica {self.refit.replica} worker: the refit was "
                                                 f"superseded (a new init, or shutdown) before every member joined")
        if executor is not None:  # bounded by the transport's timeout: a release waiting on a frozen peer
            from ...executors.base import close_within

            timeout = transport_timeout(self.refit.options, (self.refit.rendezvous or {}).get("timeout"))
            close_within(executor.close, timeout, "closing this worker's executor")
        installer = getattr(self, "installer", None)  # absent when set-up failed before binding
        if installer is not None:
            installer.close()
        self.store = None


def _injected_flip_fault(rank: int, wrote: bool) -> None:
    """Tests only: $RESHARD_TEST_FLIP_FAULT names a file; while it holds this worker's rank, the worker's flip
    raises before it writes (`wrote` False); while it holds "<rank> kill", the worker SIGKILLs itself once its flip
    wrote the live weights, before it reports the install (`wrote` True). Read at each flip: a test arms and
    disarms it between refits."""
    path = os.environ.get("RESHARD_TEST_FLIP_FAULT")
    armed = Path(path).read_text().split() if path and os.path.exists(path) else []
    if armed == [str(rank)] and not wrote:
        raise ExecutionError(f"injected flip fault (RESHARD_TEST_FLIP_FAULT) on rank {rank}")
    if armed == [str(rank), "kill"] and wrote:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def transport_timeout(options: dict[str, Any], default: Any) -> float:
    """The transport's timeout from a refit's options (validated by the executor that uses it), else `default`,
    else 300 s."""
    for v in (options.get("timeout"), default):
        if not isinstance(v, bool) and isinstance(v, (int, float)) and v > 0:
            return float(v)
    return 300.0


def check_served_model(refit: RefitSpec, dst: Any, vllm_config: Any) -> None:
    """The trainer's model and destination layout must be what the engine of `vllm_config` serves (an adapter's:
    the model it adapts; the LoRA settings are AdapterSlot's to check): the same spec, the same math (the HF config
    fields that change no shape, `refit.math`: compared with the engine's own config unless the trainer sent none)
    and the same parallel layout.

    Raises:
        LayoutMismatchError: naming what differs, before any byte moves.
    """
    live = spec_of(vllm_config)
    model = base_spec(dst.model) if isinstance(dst, VllmLoraLayout) else dst.model
    ours = model.model_copy(update={"dtype": live.dtype})
    if ours != live:
        raise LayoutMismatchError(str(dst), [f"trainer: {model}", f"vLLM: {live}"], where="the vLLM model")
    if refit.math is not None:  # fields that change the math, not the shapes (layouts.math_config)
        from ...layouts.math_config import math_config, math_differences, math_fingerprint

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
    if declared.model_dump(exclude={"model"}) != dst.model_dump(exclude=lora):
        mine, theirs = dst.model_dump(exclude=lora), declared.model_dump(exclude={"model"})
        differ = ", ".join(f"{k}: {mine[k]!r} vs {theirs[k]!r}" for k in mine if mine[k] != theirs.get(k))
        raise LayoutMismatchError(str(dst), [f"trainer declared {dst}, the engine runs {declared} ({differ})"],
                                  where="this vLLM engine's parallel config")
