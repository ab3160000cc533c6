"""One process's NIXL side of a refit, set up once and used by every refit: its agent, its registered memory,
its peers (their agents loaded, their address books checked) and one prepared transfer per link it initiates.

Set-up (`Connection(...)`, once per executor): make the agent; register the memory regions peers address;
publish the agent's metadata and this process's address book to the store; read every peer's back and check
that it runs the same refit (plan digest, binding, shared options, direction, thresholds); prepare the
descriptor lists of every link this process initiates (executors.nixl.descriptors) and make them into transfer
handles; connect to every peer. A refit then only posts those handles and exchanges notifications, through
`post`, `state`, `notify` and `notifications`. Every NIXL error becomes an ExecutionError naming the link.

No agent is released while a peer may still connect to it: UCX can abort the process (an assertion on its async
thread) whose connection to a released agent fails. A failed set-up says so in the store, and the peers still
setting up stop before their next connect (at once, not at their timeout; a peer that had already finished finds
out at its first refit). Every release, after a failure or a close, first waits until each peer that could know
the agent (those that published) has left set-up, for at most `leave_grace(timeout)`: a peer that died after
publishing cannot hold it longer, and long after set-up the wait is one look at the store per peer.
"""
from __future__ import annotations

import time
from typing import Any, Iterator

import numpy as np

from ...errors import ExecutionError
from ...polling import poll
from ..exchange import Exchange
from .agent import describe, is_nixl_error, make_agent
from .descriptors import merged_regions, region_array, side_descriptors
from .schedule import Link, LinkSchedule

SHARED_KEYS = ("plan", "binding", "options", "direction", "pack_below", "land_below", "delta")  # equal in every book


class Connection:
    """See the module docstring. `book`: this process's address book (SHARED_KEYS, "process", "mem", "device",
    "addresses": memory name -> address); `regions`: (address, bytes) of the memory peers address."""

    def __init__(self, schedule: LinkSchedule, name: str, exchange: Exchange, book: dict[str, Any],
                 regions: list[tuple[int, int]], itemsize: int, timeout: float, progress_delay_us: int) -> None:
        self.schedule = schedule
        self.agent: Any = None
        self.handles: dict[int, Any] = {}  # link id -> transfer handle (links this process initiates)
        self.names: dict[int, str] = {}  # peer process -> its agent's name
        self.peer_of: dict[str, int] = {}  # agent name -> peer process
        self.book, self.books = book, {}  # this process's address book, and each peer's
        self._dlists: list[Any] = []
        self._reg: Any = None
        self._exchange, self._grace = exchange, leave_grace(timeout)
        try:
            self._set_up(name, exchange, book, regions, itemsize, timeout, progress_delay_us)
        except BaseException as e:
            if schedule.peers:
                exchange.fail_setup(schedule.process, describe(e) if is_nixl_error(e) else str(e) or repr(e))
                exchange.leave_setup(schedule.process)
            self.release()
            raise
        if schedule.peers:
            exchange.leave_setup(schedule.process)

    def _set_up(self, name: str, exchange: Exchange, book: dict[str, Any], regions: list[tuple[int, int]],
                itemsize: int, timeout: float, progress_delay_us: int) -> None:
        s = self.schedule
        if not s.peers:  # only local copies here: no agent, nothing to register or exchange
            return
        self.agent = make_agent(name, progress_delay_us)
        regions = merged_regions(regions)
        if regions:
            self._reg = self.agent.register_memory(region_array(regions, book["device"]), book["mem"])
        exchange.publish(s.process, self.agent.get_agent_metadata(), book)
        books: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        for peer in s.peers:
            metadata, theirs = exchange.fetch(peer, timeout, deadline)
            exchange.raise_if_setup_failed()  # before loading (and later connecting to) a peer that may be gone
            _check_peer(s.process, peer, theirs, book)
            loaded = _nixl_call(self.agent.add_remote_agent, f"loading process {peer}'s agent (it connects to it)",
                                metadata)
            loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded != theirs["agent"]:
                raise ExecutionError(f"process {peer}'s metadata names agent {loaded!r}, its book {theirs['agent']!r}")
            self.names[peer] = loaded
            self.peer_of[loaded] = peer
            books[peer] = self.books[peer] = theirs
        read = s.direction == "read"
        op = "READ" if read else "WRITE"
        here, there = ("recv", "send") if read else ("send", "recv")
        for link in s.links:
            if not s.initiates(link):
                continue
            peer = link.sender if read else link.receiver
            local = side_descriptors(link, here, book["addresses"], itemsize, book["device"], "this process")
            remote = side_descriptors(link, there, books[peer]["addresses"], itemsize, int(books[peer]["device"]),
                                      f"process {peer}")
            try:
                lh = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, book["mem"])
                self._dlists.append(lh)
                rh = self.agent.prep_xfer_dlist(self.names[peer], remote, books[peer]["mem"])
                self._dlists.append(rh)
                index = np.arange(len(local), dtype=np.int32)
                self.handles[link.id] = self.agent.make_prepped_xfer(op, lh, index, rh, index)
            except Exception as e:
                if is_nixl_error(e):
                    raise ExecutionError(f"NIXL refused to prepare {link}: {describe(e)}") from e
                raise
        for peer in s.peers:
            exchange.raise_if_setup_failed()
            _nixl_call(self.agent.make_connection, f"connecting to process {peer}'s agent", self.names[peer])
        exchange.raise_if_setup_failed()  # a peer failed meanwhile: it releases its agent once this one has left

    # --- used by a refit -----------------------------------------------------------------------------
    def post(self, link: Link, message: bytes) -> None:
        """Post the link's prepared transfer; NIXL delivers `message` to the peer once it completed."""
        peer = link.peer(self.schedule.process)
        try:
            state = self.agent.transfer(self.handles[link.id], message)
        except Exception as e:
            if is_nixl_error(e):
                raise ExecutionError(f"posting {link} with process {peer} failed: {describe(e)}") from e
            raise
        if state not in ("DONE", "PROC"):
            raise ExecutionError(f"posting {link} with process {peer} returned {state}")

    def write(self, peer: int, local: int, remote: int, nbytes: int, message: bytes, deadline: float,
              poll_max_s: float, what: str) -> None:
        """WRITE `nbytes` from this process's registered memory at address `local` into process `peer`'s at
        `remote` (a transfer made for this size, released once done), waiting for it until `deadline`; NIXL
        delivers `message` to the peer after the bytes.

        Raises:
            ExecutionError: NIXL failed, or the deadline passed.
        """
        agent, mem = self.agent, self.book["mem"]
        handle = None
        try:
            here = agent.get_xfer_descs([(int(local), int(nbytes), int(self.book["device"]))], mem)
            there = agent.get_xfer_descs([(int(remote), int(nbytes), int(self.books[peer]["device"]))],
                                         self.books[peer]["mem"])
            handle = agent.initialize_xfer("WRITE", here, there, self.names[peer], message)
            state = [agent.transfer(handle, message)]

            def done() -> bool:
                if state[0] == "PROC":
                    state[0] = agent.check_xfer_state(handle)
                if state[0] not in ("DONE", "PROC"):
                    raise ExecutionError(f"writing {what} to process {peer} ended in state {state[0]}")
                return state[0] == "DONE"

            if not poll(done, deadline, first_s=2e-5, most_s=poll_max_s):
                raise ExecutionError(f"timed out writing {what} ({nbytes} bytes) to process {peer}")
        except Exception as e:
            if is_nixl_error(e):
                raise ExecutionError(f"writing {what} to process {peer} failed: {describe(e)}") from e
            raise
        finally:
            if handle is not None:
                try:
                    agent.release_xfer_handle(handle)
                except Exception:  # noqa: BLE001 - a handle of a dead peer may refuse; nothing else to do
                    pass

    def state(self, link: Link) -> str:
        """"DONE", "PROC" or, for a transfer that failed, another state."""
        return self.agent.check_xfer_state(self.handles[link.id])

    def notify(self, peer: int, message: bytes, link: Link) -> None:
        """Send `message` to process `peer`'s agent about `link`; ExecutionError if NIXL fails."""
        try:
            self.agent.send_notif(self.names[peer], message)
        except Exception as e:
            if is_nixl_error(e):
                raise ExecutionError(f"notifying process {peer} about {link} failed: {describe(e)}") from e
            raise

    def notifications(self) -> Iterator[bytes]:
        """The notifications that arrived from peers since the last call (others' are dropped)."""
        if self.agent is None:
            return
        for sender, messages in self.agent.get_new_notifs().items():
            if sender in self.peer_of:
                yield from messages

    def drop_transfers(self) -> None:
        """After a failure: stop waiting on stuck transfers (their handles cannot be reused)."""
        for lid in list(self.handles):
            handle = self.handles.pop(lid)
            try:
                self.agent.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001 - a handle of a dead peer may refuse; nothing else to do
                pass

    # --- teardown ------------------------------------------------------------------------------------
    def release(self) -> None:
        """Release handles, descriptor lists, peers and registrations (best effort), once every peer that could
        still connect to this agent has left set-up (at most the grace: see the module docstring)."""
        agent = self.agent
        if agent is None:
            return
        self._exchange.wait_left(sorted(self.schedule.peers), self._grace)
        for handle in list(self.handles.values()) + self._dlists:  # handles first: NIXL does not track them
            try:
                handle.release()
            except Exception:  # noqa: BLE001 - best effort while tearing down
                pass
        self.handles.clear()
        self._dlists.clear()
        for name in self.names.values():
            try:
                agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001
                pass
        if self._reg is not None:
            try:
                agent.deregister_memory(self._reg)
            except Exception:  # noqa: BLE001
                pass
            self._reg = None
        self.agent = None


def _nixl_call(call: Any, what: str, *args: Any) -> Any:
    """call(*args), NIXL's errors as an ExecutionError saying `what` failed."""
    try:
        return call(*args)
    except Exception as e:
        if is_nixl_error(e):
            raise ExecutionError(f"set-up: {what} failed: {describe(e)}") from e
        raise


def leave_grace(timeout: float) -> float:
    """How long a release waits for peers still setting up: a quarter of the timeout, 0.5-10 s."""
    return min(max(timeout / 4, 0.5), 10.0)


def _check_peer(process: int, peer: int, book: dict[str, Any], mine: dict[str, Any]) -> None:
    problems = [f"{key}: process {peer} has {book.get(key)!r}, process {process} has {mine[key]!r}"
                for key in SHARED_KEYS if book.get(key) != mine[key]]
    if book.get("process") != peer:
        problems.append(f"the book published for process {peer} is process {book.get('process')}'s")
    if problems:
        hint = (" (pack_below / land_below resolve per memory kind: set them explicitly when CPU and GPU "
                "processes mix)" if any(p.startswith(("pack_below", "land_below")) for p in problems) else "")
        raise ExecutionError(f"process {peer} does not run the same refit{hint}:\n  - " + "\n  - ".join(problems))
