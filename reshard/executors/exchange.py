"""Set-up exchange and refit agreement of executors whose processes meet through a torch.distributed store (NIXL,
shared memory; their refit: executors.voted). Values are bytes (NIXL's agent metadata) or JSON (never pickle),
under reshard-<transport>/<namespace>/:

  md/<p>, book/<p>  process p's blob, and what it runs and how peers address its memory
  setup/fail        the first failed set-up's reason; setup/left/<p>: p is done with set-up (success or not)
  v<g>/...          per refit version: ok (votes), fail (first reason) and the executor's own signals
"""
from __future__ import annotations

import json
import time
from typing import Any, Callable

from ..errors import ExecutionError
from ..polling import poll

PROTOCOL = 1


class _Store:
    """An exchange's store (set, get, add, check, compare_set, delete_key): a failed call (the process hosting the
    store exited, or a call timed out) raises ExecutionError naming the store, so a peer's death reaches the
    refit's caller as the refit's error."""

    def __init__(self, store: Any, namespace: str) -> None:
        self._store, self._namespace = store, namespace

    def __getattr__(self, what: str) -> Callable[..., Any]:
        call = getattr(self._store, what)

        def guarded(*args: Any) -> Any:
            try:
                return call(*args)
            except (RuntimeError, OSError) as e:
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise ExecutionError(f"the store went away (namespace {self._namespace!r}, {what}): {first}; has "
                                     f"the process that hosts it exited?") from None
        return guarded


class Exchange:
    """The store keys through which an executor's processes set up and agree on each refit.

    Args:
        store: a torch.distributed store every process of the binding reaches.
        namespace: this executor's name in the store (no '/'), so that several share one store.
        transport: the executor kind, the keys' outer prefix.

    Raises:
        ExecutionError: `namespace` is empty or holds '/'.
    """

    def __init__(self, store: Any, namespace: str, transport: str = "nixl") -> None:
        import torch.distributed as dist

        if not namespace or "/" in namespace:
            raise ExecutionError(f"namespace={namespace!r} must be a non-empty name without '/'")
        self.namespace = namespace
        self.store = _Store(dist.PrefixStore(f"reshard-{transport}/{namespace}/", store), namespace)

    # --- set-up ----------------------------------------------------------------------------------------
    def publish(self, process: int, metadata: bytes, book: dict[str, Any]) -> None:
        """Process `process`'s blob and book, for its peers to `fetch`."""
        self.store.set(f"book/{process}", json.dumps({"protocol": PROTOCOL, **book}).encode())
        self.store.set(f"md/{process}", metadata)  # last: a peer that sees md sees the book too

    def fetch(self, peer: int, timeout: float, deadline: float | None = None) -> tuple[bytes, dict[str, Any]]:
        """Peer's agent metadata and book; waits for them at most `timeout` seconds, and not past `deadline` (a
        time.monotonic(): the set-up's, shared by every peer fetched, so that n absent peers cost one timeout)."""
        left = timeout if deadline is None else max(min(timeout, deadline - time.monotonic()), 0.001)
        key = f"md/{peer}"
        # polled, not store.wait: CI once saw every process of a NIXL set-up sit its whole timeout in store.wait on
        # keys that all of them had set before waiting (each publishes before it fetches)
        if not poll(lambda: self._published(key, peer), time.monotonic() + left, first_s=0.002, most_s=0.05,
                    between=self.raise_if_setup_failed):
            raise ExecutionError(f"set-up: process {peer} did not publish its metadata within {timeout:.1f} s "
                                 f"(namespace {self.namespace!r}); is every process of the binding building "
                                 f"its executor?")
        book = json.loads(self.store.get(f"book/{peer}").decode())
        if book.get("protocol") != PROTOCOL:
            raise ExecutionError(f"process {peer} speaks exchange protocol {book.get('protocol')}, "
                                 f"this process {PROTOCOL}")
        return self.store.get(f"md/{peer}"), book

    def _published(self, key: str, peer: int) -> bool:
        try:
            return bool(self.store.check([key]))
        except ExecutionError as e:  # the store's host is gone
            raise ExecutionError(f"set-up: {e} (while this process waited for process {peer}'s metadata)") from None

    def fail_setup(self, process: int, reason: str) -> None:
        """Tell the peers still setting up that this process's set-up failed (the first reason stays)."""
        self._first_reason("setup/fail", f"process {process}: {reason}")

    def raise_if_setup_failed(self) -> None:
        """Raise ExecutionError if another process's set-up failed (a store gone away: the caller's wait says so)."""
        try:
            reason = self._reason("setup/fail")
        except ExecutionError:  # the store went away: the caller's own wait reports that
            return
        if reason is not None:
            raise ExecutionError(f"set-up: another process failed first ({reason})")

    def leave_setup(self, process: int) -> None:
        """This process is done with set-up (it succeeded or failed): it connects to no peer any more."""
        try:
            self.store.set(f"setup/left/{process}", b"1")
        except Exception:  # noqa: BLE001 - best effort
            pass

    def wait_left(self, peers: list[int], seconds: float) -> list[int]:
        """Wait at most `seconds` until each of `peers` that published its metadata has left set-up (a peer that
        never published cannot know this process's agent); returns those still in set-up."""
        def still_in() -> list[int]:
            try:
                return [p for p in peers
                        if self.store.check([f"md/{p}"]) and not self.store.check([f"setup/left/{p}"])]
            except ExecutionError:  # the store is gone: so is every peer's way to this agent's metadata
                return []
        return [] if poll(lambda: not still_in(), time.monotonic() + seconds, first_s=0.002) else still_in()

    def wait_set_up(self, peers: list[int], version: int, deadline: float, poll_max_s: float) -> None:
        """Return once each of `peers` has left set-up; raise if refit `version` failed or the deadline passes,
        naming the peers still setting up."""
        def still_in() -> list[int]:
            return [p for p in peers if not self.store.check([f"setup/left/{p}"])]

        if not poll(lambda: not still_in(), deadline, most_s=poll_max_s,
                    between=lambda: (self.raise_if_setup_failed(),
                                     self._raise_if_failed(version, "its peers to finish setting up"))):
            late = still_in()
            raise ExecutionError(f"timed out: peer process(es) {late[:10]} did not finish setting up (loading "
                                 f"their peers' agents); nothing was sent to them")

    # --- agreement on a refit --------------------------------------------------------------------------
    def fail(self, version: int, reason: str) -> None:
        """Tell every process that refit `version` failed (the first reason stays)."""
        self._first_reason(f"v{version}/fail", reason)

    def failure(self, version: int) -> str | None:
        """The first reason given for refit `version`'s failure, or None while none failed."""
        return self._reason(f"v{version}/fail")

    def _first_reason(self, key: str, reason: str) -> None:
        try:
            self.store.compare_set(key, "", reason.encode()[:4000])
        except Exception:  # noqa: BLE001 - best effort: the store itself may be gone
            pass

    def _reason(self, key: str) -> str | None:
        return self.store.get(key).decode(errors="replace") if self.store.check([key]) else None

    def vote(self, version: int) -> int:
        """Count this process as having finished and verified refit `version`; returns the votes so far."""
        return int(self.store.add(f"v{version}/ok", 1))

    def wait_all(self, version: int, processes: int, deadline: float, poll_max_s: float) -> None:
        """Return once all `processes` voted for `version`; raise if one failed or the deadline passes."""
        key = f"v{version}/ok"
        if not poll(lambda: self.count(key) >= processes, deadline, most_s=poll_max_s,
                    between=lambda: self._raise_if_failed(version, "")):
            raise ExecutionError(f"timed out: only {self.count(key)} of {processes} processes finished the refit; "
                                 f"the others failed, hang or died")

    def _raise_if_failed(self, version: int, waiting_for: str) -> None:
        reason = self.failure(version)
        if reason is not None:
            raise ExecutionError(f"another process failed first ({reason})"
                                 + (f" while this one waited for {waiting_for}" if waiting_for else ""))

    def signal(self, key: str) -> None:
        """Count one more at `key` (a per-refit signal such as v<g>/ready/<p>)."""
        self.store.add(key, 1)

    def count(self, key: str) -> int:
        """The counter at `key` now (0 if never signalled)."""
        return int(self.store.add(key, 0))

    def wait_count(self, key: str, want: int, version: int, deadline: float, poll_max_s: float, what: str) -> None:
        """Return once the counter at `key` reached `want`; raise if refit `version` failed or the deadline passes."""
        if not poll(lambda: self.count(key) >= want, deadline, most_s=poll_max_s,
                    between=lambda: self._raise_if_failed(version, what)):
            raise ExecutionError(f"timed out waiting for {what}")

    def forget(self, version: int, keys: tuple[str, ...] = ()) -> None:
        """Drop a finished version's keys (every process has passed its vote), and `keys` of it."""
        for key in (f"v{version}/ok", f"v{version}/fail", *keys):
            try:
                self.store.delete_key(key)
            except Exception:  # noqa: BLE001 - not every store deletes; the keys are a few bytes
                pass


def same_refit(process: int, peer: int, theirs: dict[str, Any], mine: dict[str, Any], keys: tuple[str, ...],
               hint: str = "") -> None:
    """Raise ExecutionError, listing every difference, unless peer's book (`theirs`) is its own and has this
    process's values (`mine`) at `keys`; `hint` follows the summary."""
    problems = [f"{key}: process {peer} has {theirs.get(key)!r}, process {process} has {mine[key]!r}"
                for key in keys if theirs.get(key) != mine[key]]
    if theirs.get("process") != peer:
        problems.append(f"the book published for process {peer} is process {theirs.get('process')}'s")
    if problems:
        raise ExecutionError(f"process {peer} does not run the same refit{hint}:\n  - " + "\n  - ".join(problems))
