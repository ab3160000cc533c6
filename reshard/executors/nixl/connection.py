"""One process's NIXL side of a refit, set up once and used by every refit: its agent, its registered memory,
its peers (their agents loaded, their address books checked) and one prepared transfer per link it initiates.

Set-up publishes the agent's metadata and this process's address book to the store, reads every peer's back and
checks that it runs the same refit, prepares the descriptor lists and transfer handles, and connects to every
peer; a refit only posts handles and exchanges notifications. NIXL errors become ExecutionErrors naming the link.

A descriptor is a row (address, bytes, device id) of an Nx3 uint64 array, as NIXL's prep_xfer_dlist and
register_memory take; an address book's "addresses" map a memory's name (`memory_name`) to its first byte.

No agent is released while a peer may still connect to it (UCX can abort a process whose connection to a released
agent fails): a failed set-up says so in the store, so peers still setting up stop before their next connect, and
every release first waits, at most a quarter of the timeout (0.5-10 s), until each peer that published has left set-up.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

import numpy as np

from ...errors import ExecutionError
from ...polling import poll
from ..copies import KIND_NAMES
from ..exchange import Exchange, same_refit
from .agent import describe, is_nixl_error, make_agent
from .schedule import Link, LinkSchedule

SHARED_KEYS = ("plan", "binding", "options", "direction", "pack_below", "land_below", "delta")  # equal in every book
PACKING_HINT = (" (pack_below / land_below resolve per memory kind: set them explicitly when CPU and GPU processes "
                "mix)")
MEMORY_PREFIX = "SDHW"  # SRC, DST, SHADOW, WIRE as one letter in address books


def memory_name(kind: int, ident: int) -> str:
    """Memory (kind, id)'s name in an address book: the kind's letter of MEMORY_PREFIX, then the id."""
    return f"{MEMORY_PREFIX[kind]}{ident}"


def side_descriptors(link: Link, side: str, addresses: Mapping[str, int], itemsize: int, device: int,
                     owner: str) -> np.ndarray:
    """Nx3 descriptors of one side ("send" or "recv") of a link's pieces."""
    p = link.pieces
    kinds, ids, offs = p[f"{side}_kind"], p[f"{side}_id"], p[f"{side}_off"]
    keys = kinds * (1 << 40) + ids
    uniq, inverse = np.unique(keys, return_inverse=True)
    bases = np.empty(len(uniq), dtype=np.int64)
    for i, key in enumerate(uniq.tolist()):
        kind, ident = divmod(key, 1 << 40)
        name = memory_name(kind, ident)
        if name not in addresses:
            raise ExecutionError(f"{link}: {owner} published no address for its {KIND_NAMES[kind]} {ident}")
        bases[i] = addresses[name]
    out = np.empty((len(kinds), 3), dtype=np.uint64)
    out[:, 0] = (bases[inverse.reshape(-1)] + offs * itemsize).astype(np.uint64)
    out[:, 1] = (p["numel"] * itemsize).astype(np.uint64)
    out[:, 2] = device
    return out


def merged_regions(regions: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(address, nbytes) regions with overlapping ones merged (tensors viewing one buffer register once).
    Regions that only touch stay apart: on GPUs two allocations may be adjacent yet separate."""
    out: list[list[int]] = []
    for addr, n in sorted(r for r in regions if r[1] > 0):
        if out and addr < out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], addr + n - out[-1][0])
        else:
            out.append([addr, n])
    return [(a, n) for a, n in out]


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
        self._exchange, self._grace = exchange, min(max(timeout / 4, 0.5), 10.0)
        try:
            self._set_up(name, exchange, book, regions, itemsize, timeout, progress_delay_us)
        except BaseException as e:
            if schedule.part.peers:
                exchange.fail_setup(schedule.process, describe(e) if is_nixl_error(e) else str(e) or repr(e))
                exchange.leave_setup(schedule.process)
            self.release()
            raise
        if schedule.part.peers:
            exchange.leave_setup(schedule.process)

    def _set_up(self, name: str, exchange: Exchange, book: dict[str, Any], regions: list[tuple[int, int]],
                itemsize: int, timeout: float, progress_delay_us: int) -> None:
        s = self.schedule
        if not s.part.peers:  # only local copies here: no agent, nothing to register or exchange
            return
        self.agent = make_agent(name, progress_delay_us)
        regions = merged_regions(regions)
        if regions:  # Nx3 descriptors (address, bytes, device)
            self._reg = self.agent.register_memory(
                np.asarray([(a, n, book["device"]) for a, n in regions], dtype=np.uint64), book["mem"])
        exchange.publish(s.process, self.agent.get_agent_metadata(), book)
        books = self.books
        deadline = time.monotonic() + timeout
        for peer in s.part.peers:
            metadata, theirs = exchange.fetch(peer, timeout, deadline)
            exchange.raise_if_setup_failed()  # before loading (and later connecting to) a peer that may be gone
            mixed = any(theirs.get(k) != book[k] for k in ("pack_below", "land_below"))
            same_refit(s.process, peer, theirs, book, SHARED_KEYS, PACKING_HINT if mixed else "")
            with _nixl_errors(f"set-up: loading process {peer}'s agent (it connects to it)"):
                loaded = self.agent.add_remote_agent(metadata)
            loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded != theirs["agent"]:
                raise ExecutionError(f"process {peer}'s metadata names agent {loaded!r}, its book {theirs['agent']!r}")
            self.names[peer] = loaded
            self.peer_of[loaded] = peer
            books[peer] = theirs
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
            with _nixl_errors(f"set-up: preparing {link}"):
                lh = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, book["mem"])
                self._dlists.append(lh)
                rh = self.agent.prep_xfer_dlist(self.names[peer], remote, books[peer]["mem"])
                self._dlists.append(rh)
                index = np.arange(len(local), dtype=np.int32)
                self.handles[link.id] = self.agent.make_prepped_xfer(op, lh, index, rh, index)
        for peer in s.part.peers:
            exchange.raise_if_setup_failed()
            with _nixl_errors(f"set-up: connecting to process {peer}'s agent"):
                self.agent.make_connection(self.names[peer])
        exchange.raise_if_setup_failed()  # a peer failed meanwhile: it releases its agent once this one has left

    def post(self, link: Link, message: bytes) -> None:
        """Post the link's prepared transfer; NIXL delivers `message` to the peer once it completed."""
        peer = link.peer(self.schedule.process)
        with _nixl_errors(f"posting {link} with process {peer}"):
            state = self.agent.transfer(self.handles[link.id], message)
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
        agent, mem, handle = self.agent, self.book["mem"], None

        def done() -> bool:
            if state[0] == "PROC":
                state[0] = agent.check_xfer_state(handle)
            if state[0] not in ("DONE", "PROC"):
                raise ExecutionError(f"writing {what} to process {peer} ended in state {state[0]}")
            return state[0] == "DONE"

        try:
            with _nixl_errors(f"writing {what} to process {peer}"):
                here = agent.get_xfer_descs([(int(local), int(nbytes), int(self.book["device"]))], mem)
                there = agent.get_xfer_descs([(int(remote), int(nbytes), int(self.books[peer]["device"]))],
                                             self.books[peer]["mem"])
                handle = agent.initialize_xfer("WRITE", here, there, self.names[peer], message)
                state = [agent.transfer(handle, message)]
                if not poll(done, deadline, first_s=2e-5, most_s=poll_max_s):
                    raise ExecutionError(f"timed out writing {what} ({nbytes} bytes) to process {peer}")
        finally:
            if handle is not None:
                _quietly(agent.release_xfer_handle, handle)

    def state(self, link: Link) -> str:
        """"DONE", "PROC" or, for a transfer that failed, another state."""
        return self.agent.check_xfer_state(self.handles[link.id])

    def notify(self, peer: int, message: bytes, link: Link) -> None:
        """Send `message` to process `peer`'s agent about `link`; ExecutionError if NIXL fails."""
        with _nixl_errors(f"notifying process {peer} about {link}"):
            self.agent.send_notif(self.names[peer], message)

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
            _quietly(self.agent.release_xfer_handle, self.handles.pop(lid))

    def release(self) -> None:
        """Release handles, descriptor lists, peers and registrations (best effort), once every peer that could
        still connect to this agent has left set-up (at most the grace: see the module docstring)."""
        agent = self.agent
        if agent is None:
            return
        self._exchange.wait_left(sorted(self.schedule.part.peers), self._grace)
        for handle in list(self.handles.values()) + self._dlists:  # handles first: NIXL does not track them
            _quietly(handle.release)
        self.handles.clear()
        self._dlists.clear()
        for name in self.names.values():
            _quietly(agent.remove_remote_agent, name)
        if self._reg is not None:
            _quietly(agent.deregister_memory, self._reg)
            self._reg = None
        self.agent = None


@contextmanager
def _nixl_errors(what: str) -> Iterator[None]:
    """NIXL's errors inside the block as an ExecutionError saying `what` failed."""
    try:
        yield
    except Exception as e:
        if is_nixl_error(e):
            raise ExecutionError(f"{what} failed: {describe(e)}") from e
        raise


def _quietly(call: Any, *args: Any) -> None:
    """call(*args), best effort: a handle or agent of a dead peer may refuse its release."""
    try:
        call(*args)
    except Exception:  # noqa: BLE001 - nothing else to do while tearing down
        pass
