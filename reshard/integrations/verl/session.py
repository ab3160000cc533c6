"""One refit of the verl backend on one process: its group, its transfer thread and the keys through which every
process of the refit agrees (engine.py drives it; no verl here).

Every process of a refit (M trainer ranks, N rollout ranks) agrees through keys in the refit's store, under its
secret namespace (adapters.rendezvous):

    go/<i>       the group k the trainer ranks move i-th (the first trainer rank's to post it; another value
                 from another trainer rank fails the refit: their streams differ). A trainer rank posts it once
                 every tensor of group k came in its stream and passed the checks, so groups move in the order the
                 stream completes them, whatever order the model's groups are cut in (engine.py, send_weights).
    gate/<i>     the decision on the i-th group, made once: k (open: the M-th trainer rank to post go/<i> sets it)
                 or "closed" (a failing process closes every gate not yet decided).
    done/<k>     a counter: the processes that finished moving group k.
    end          a counter: the trainer ranks whose stream ended clean (every tensor once, nothing unknown).
    fail         the first failure's reason (adapters.rendezvous.fail), which every other wait checks.

Every live process enters the transfer of every open gate's group, and none enters a closed one's. So a trainer
rank that refuses its stream never leaves a peer waiting inside a transfer (a gloo receive is woken only by its
timeout or its peer's exit, not by the peer closing its group): it posts `fail`, closes the gates still open to
decision, takes part in the transfers already opened (at most two groups), and every other process raises at its
next wait, within milliseconds.
"""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

from ...adapters import rendezvous as rv
from ...errors import ExecutionError, ReshardError
from ...executors.binding import Binding
from ...polling import poll
from ..groups import group_executor
from .topology import RefitAssignment

_MOST_S = 0.01  # longest sleep between two looks at the store: what a failure adds to a waiting process's wait


class RefitSession:
    """One process's part of one refit: made in `init_process_group`, closed by `finalize` or the next `prepare`.
    A call of the backend keeps the session it started with, so a failed refit's leftovers (a transfer still
    finishing on its thread) never touch the next refit's.

    Args:
        top: this process's assignment (engine's `init_process_group`).
        plans, bindings: every group's plan and who plays its ranks.
        groups: the model's tensor groups (the plans' order).
        store, rdv: the refit's store (joined) and rendezvous.
        comm: the collective transport's group (None for the others).
        options: the backend's checked options.
        device: the CUDA device the transfer thread works on (None: CPU).
    """

    def __init__(self, top: RefitAssignment, plans: Sequence[Any], bindings: Sequence[Binding],
                 groups: Sequence[Sequence[str]], store: Any, rdv: rv.Rendezvous, comm: Any,
                 options: dict[str, Any], device: torch.device | None) -> None:
        self.top, self.plans, self.bindings, self.groups = top, plans, bindings, groups
        self.store, self.rdv, self.comm, self.options = store, rdv, comm, options
        self.keys = rv.scoped(store, rdv, "verl")
        self.timeout = float(options.get("timeout", 300.0))
        self.size = top.trainers + top.rollouts
        self.role = "trainer" if top.is_trainer else "rollout"
        self.stop = threading.Event()  # set on a failure seen here and at close: the waits of this session end
        # one thread moves the groups, in order; the caller's event loop stays free (verl's actors are async)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=f"reshard-verl-{self.role}",
                                       initializer=torch.cuda.set_device if device is not None else None,
                                       initargs=(device,) if device is not None else ())

    # --- the keys ----------------------------------------------------------------------------------------
    def post_go(self, i: int, k: int) -> None:
        """This trainer rank has group k whole and checked, as the i-th group it moves; the last trainer rank to
        say so opens gate i.

        Raises:
            ExecutionError: another trainer rank moves another group i-th (posted as the refit's failure).
        """
        first = self.keys.compare_set(f"go/{i}", "", str(k))
        first = first.decode() if isinstance(first, bytes) else first
        if first != str(k):
            raise self.fail(ExecutionError(f"the trainer ranks completed different groups as their group {i + 1} "
                                           f"({first} and {k}): their streams differ (a tensor missing or out of "
                                           f"place on some of them)"))
        if int(self.keys.add(f"go/{i}/count", 1)) == self.top.trainers:
            self.keys.compare_set(f"gate/{i}", "", str(k))

    def wait_gate(self, i: int) -> int:
        """Block until gate i is decided (on the transfer thread); returns the group to move.

        Raises:
            ExecutionError: the gate is closed (a process failed: its reason), the session was closed, or no
                decision within the timeout.
        """
        key = f"gate/{i}"
        if not poll(lambda: self.keys.check([key]), time.monotonic() + self.timeout, first_s=1e-4, most_s=_MOST_S,
                    between=self._closed):
            raise ExecutionError(f"{self._who()}: the trainer ranks did not all complete their group {i + 1} of "
                                 f"{len(self.groups)} within {self.timeout:.0f} s")
        value = self.keys.get(key).decode()
        if value == "closed":
            self.stop.set()
            raise ExecutionError(f"{self._who()}: the refit failed: {self.failure()}")
        return int(value)

    def post_done(self, k: int) -> None:
        self.keys.add(f"done/{k}", 1)

    def post_end(self) -> None:
        """This trainer rank's stream ended clean and every group it moved is done."""
        self.keys.add("end", 1)

    async def agreed(self, k: int) -> None:
        """Return once every process finished moving group k (on the event loop, which stays free)."""
        await self._until(lambda: int(self.keys.add(f"done/{k}", 0)) >= self.size,
                          f"every process of the refit to finish group {k}")

    async def ended(self) -> None:
        """Return once every trainer rank's stream ended clean (the trainers' end-of-stream verdict)."""
        await self._until(lambda: int(self.keys.add("end", 0)) >= self.top.trainers,
                          "the trainer ranks' end-of-stream verdict")

    def check(self) -> None:
        """Raise if any process posted a failure or this session was closed."""
        reason = self.failure()
        if reason is not None:
            self.stop.set()
            raise ExecutionError(f"{self._who()}: the refit failed: {reason}")
        self._closed()

    def _closed(self) -> None:
        if self.stop.is_set():
            raise ExecutionError(f"{self._who()}: the refit was closed before it ended (a failure, the next "
                                 f"refit's prepare, or finalize)")

    def failure(self) -> str | None:
        try:
            return rv.failure(self.store, self.rdv)
        except Exception as e:  # noqa: BLE001 - the store's host (trainer rank 0) is gone: that is a failure too
            return f"the refit's store at {self.rdv.address} is gone ({type(e).__name__})"

    def fail(self, error: BaseException) -> BaseException:
        """Tell every process of the refit why it fails (the first reason stays) and close every gate not yet
        decided; returns `error`. Gates already open stay open: this process still takes part in their groups."""
        rv.fail(self.store, self.rdv, f"{self._who()}: {error}")
        try:
            for i in range(len(self.groups)):
                self.keys.compare_set(f"gate/{i}", "", "closed")
        except Exception:  # noqa: BLE001 - best effort: the store's host may be gone (then so is the refit)
            pass
        self.stop.set()
        return error

    # --- moving ------------------------------------------------------------------------------------------
    def submit(self, fn: Callable[..., Any], *args: Any) -> "asyncio.Future[Any]":
        """Run `fn(*args)` on the transfer thread; an awaitable for the caller's event loop."""
        future: Future = self.pool.submit(fn, *args)
        return asyncio.wrap_future(future)

    def move(self, k: int, src: dict[str, torch.Tensor] | None = None,
             dst: dict[str, torch.Tensor] | None = None) -> int:
        """Move group k (this process's part), then count it done; returns the bytes this process sent. On the
        transfer thread, once its gate is open.

        Raises:
            ReshardError: the transfer failed (posted as the refit's failure unless a peer's came first).
        """
        top, binding = self.top, self.bindings[k]
        src = {binding.src_ranks_of(top.process)[0]: src} if src is not None else {}
        dst = {binding.dst_ranks_of(top.process)[0]: dst} if dst is not None else {}
        try:
            ex = group_executor(self.options.get("transport", "collective"), self.plans[k], binding, top.process,
                                src, dst, store=self.store, rendezvous=self.rdv, namespace=f"{self.rdv.refit_id}g{k}",
                                comm=self.comm, timeout=self.timeout, checksum=self.options.get("checksum", False),
                                memory_cap=top.bucket_size)
            try:
                stats = ex.refit()
            finally:
                ex.close()
        except ReshardError as e:
            raise self.fail(self._explained(e, k)) from e
        except Exception as e:  # noqa: BLE001 - a transport's own error: name the group, keep the cause
            raise self.fail(self._explained(ExecutionError(f"{type(e).__name__}: {e}"), k)) from e
        self.post_done(k)
        return sum(stats.bytes_sent.values())

    def close(self) -> None:
        """End this session's waits and let its thread go (a transfer in flight finishes on its own, bounded by
        the timeout); close the collective group in the background: after a failure its shutdown waits for the
        gloo operations still posted to time out (a killed trainer rank: 47 s of the 60 s timeout), which must
        not hold the next refit."""
        self.stop.set()
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.comm is not None:
            threading.Thread(target=self.comm.close, daemon=True, name="reshard-verl-close").start()
            self.comm = None

    # --- internals ---------------------------------------------------------------------------------------
    async def _until(self, done: Callable[[], bool], what: str) -> None:
        deadline, pause = time.monotonic() + self.timeout, 1e-4
        while not done():
            self.check()
            if time.monotonic() > deadline:
                raise ExecutionError(f"{self._who()}: waited {self.timeout:.0f} s for {what}")
            await asyncio.sleep(pause)
            pause = min(2 * pause, _MOST_S)

    def _explained(self, e: ReshardError, k: int) -> ReshardError:
        """A peer's failure seen here as a broken transfer: say what the failing process reported."""
        reason = self.failure()
        if reason is None or not isinstance(e, ExecutionError):
            return e
        return ExecutionError(f"refit failed in tensor group {k} of {len(self.groups)}: {reason} (here: {e})")

    def _who(self) -> str:
        p = self.top.process
        return f"trainer rank {p}" if self.top.is_trainer else f"rollout rank {p - self.top.trainers}"


__all__ = ["RefitSession"]
