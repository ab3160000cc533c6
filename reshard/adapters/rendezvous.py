"""Where the processes of one refit meet: a TCPStore every process reaches, the refit's public id, and a secret.

The trainer's driver hosts the store; the others connect to its address, carried as JSON in the init payload.
Every key lives under a namespace derived from the secret, so a process without it can neither read the refit's
keys nor take a member's place (it is refused, and `refused` lists such attempts).

    rdv, store = host_store(Rendezvous.new())   # the driver: this host's routable address, a fresh id and secret
    rdv.to_dict()                                           # into the init payload of every other member
    store = connect(Rendezvous.from_dict(d))                # a member
    members = join(store, rdv, process=3, size=6, role="engine")   # every member; duplicates refused
    executor_store = scoped(store, rdv, "collective")               # where an executor keeps its keys

A member probes the address once before connecting, so an unreachable one fails at once, naming it. The sockets
are not encrypted: bind them to an address only the refit's hosts reach (RESHARD_HOST or `host=`).
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import time
from dataclasses import MISSING, asdict, dataclass, fields
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..addresses import probe, routable_address
from ..errors import ExecutionError
from ..polling import poll

log = logging.getLogger("reshard.rendezvous")


@dataclass(frozen=True)
class Rendezvous:
    """Where one refit's processes meet and the secret that admits them.

    Attributes:
        host: the store's address, reachable from every member.
        port: its port (0 until `host_store` binds one).
        refit_id: public: names the refit in keys, logs and errors.
        secret: hex, never logged (not even by `repr`).
        timeout: seconds any step of meeting may take.

    Raises:
        ExecutionError: a field out of range (all problems named at once).
    """

    host: str
    port: int
    refit_id: str
    secret: str
    timeout: float = 60.0

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.host, str) or not self.host:
            problems.append(f"host={self.host!r} must be a non-empty string")
        if not isinstance(self.port, int) or isinstance(self.port, bool) or not 0 <= self.port < 65536:
            problems.append(f"port={self.port!r} must be an integer in [0, 65536)")
        if not isinstance(self.refit_id, str) or not self.refit_id.isalnum() or len(self.refit_id) > 64:
            problems.append(f"refit_id={self.refit_id!r} must be 1-64 letters or digits")
        if not isinstance(self.secret, str) or len(self.secret) < 16:
            problems.append("secret must be a string of at least 16 characters")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) \
                or not 0 < self.timeout <= 86400:
            problems.append(f"timeout={self.timeout!r} must be a number of seconds in (0, 86400]")
        if problems:
            raise ExecutionError("invalid rendezvous: " + "; ".join(problems))

    @classmethod
    def new(cls, host: str | None = None, port: int = 0, timeout: float = 60.0) -> "Rendezvous":
        """A fresh refit id and secret at `host` (None: this host's routable address; port 0: `host_store` picks)."""
        return cls(routable_address(host), port, secrets.token_hex(6), secrets.token_hex(16), timeout)

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON values, secret included: for members only."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> "Rendezvous":
        """The rendezvous `to_dict` wrote, checked as untrusted input (unknown or missing fields refused)."""
        return from_untrusted(cls, d, "rendezvous", ExecutionError)

    def __repr__(self) -> str:  # the secret stays out of logs and error messages
        return f"Rendezvous({self.host}:{self.port}, refit {self.refit_id})"

    @property
    def address(self) -> str:
        """host:port, as errors name it."""
        return f"{self.host}:{self.port}"

    def proof(self, what: str) -> str:
        """An HMAC of `what` under the secret: a value only members can compute."""
        try:
            key = bytes.fromhex(self.secret)
        except ValueError:  # a secret given as text, not hex
            key = self.secret.encode()
        return hmac.new(key, f"{self.refit_id}/{what}".encode(), hashlib.sha256).hexdigest()

    @property
    def namespace(self) -> str:
        """Where the refit's keys live: unguessable without the secret."""
        return f"reshard/{self.refit_id}/{self.proof('namespace')[:32]}/"


def from_untrusted(cls: Any, d: Any, what: str, error: type[Exception]) -> Any:
    """`cls(**d)` for a dataclass `cls` and untrusted data `d`: a JSON object with each field that has no default and
    no other field, else `error` naming them (`what`: what `d` is)."""
    if not isinstance(d, dict):
        raise error(f"{what} must be a JSON object, got {type(d).__name__}")
    known = sorted(f.name for f in fields(cls))
    unknown = sorted(set(d) - set(known))
    missing = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING and f.name not in d]
    if unknown or missing:
        raise error(f"{what} has unknown fields {unknown}; known: {known}" if unknown else f"{what} lacks {missing}")
    return cls(**d)


def host_store(rdv: Rendezvous, store: Any = None) -> tuple[Rendezvous, Any]:
    """Host the refit's store at `rdv.address` (port 0: a free one); the rendezvous with its port, and the store.
    `store`: one this process already hosts at that address, which then holds this refit's keys too."""
    try:
        store = store if store is not None else dist.TCPStore(rdv.host, rdv.port, None, True,
                                                              timedelta(seconds=rdv.timeout), wait_for_workers=False)
    except Exception as e:  # noqa: BLE001 - the store raises several types
        raise ExecutionError(f"cannot host the refit's store at {rdv.address}: {e}") from e
    bound = Rendezvous(rdv.host, int(store.port), rdv.refit_id, rdv.secret, rdv.timeout)
    store.set(f"{bound.namespace}hosted", b"1")  # first: only members find it (check_secret)
    store.set(f"reshard/{rdv.refit_id}/check", bound.proof("check"))
    log.info("refit %s: store hosted at %s", rdv.refit_id, bound.address)
    return bound, store


def connect(rdv: Rendezvous) -> Any:
    """A client of the refit's store; ExecutionError naming the address if it cannot be reached in time."""
    probe(rdv.host, rdv.port, rdv.timeout, f"refit {rdv.refit_id}: the refit's store")  # refused: at once, not retried
    try:
        return dist.TCPStore(rdv.host, rdv.port, None, False, timedelta(seconds=rdv.timeout))
    except Exception as e:  # noqa: BLE001
        raise ExecutionError(f"refit {rdv.refit_id}: cannot reach the refit's store at {rdv.address} within "
                             f"{rdv.timeout:.0f} s ({type(e).__name__}: {e})") from e


def scoped(store: Any, rdv: Rendezvous, kind: str) -> Any:
    """The part of the store an executor of `kind` keeps its keys in (under the secret namespace)."""
    return dist.PrefixStore(f"{rdv.namespace}{kind}/", store)


def _me(role: str, process: int) -> dict[str, Any]:
    return {"role": role, "process": process, "pid": os.getpid(), "host": socket.gethostname(),
            "nonce": secrets.token_hex(8)}


def check_secret(store: Any, rdv: Rendezvous, role: str, process: int) -> None:
    """Raise (and leave a note for the host) if this member's secret is not the refit's."""
    public, hosted = f"reshard/{rdv.refit_id}/check", f"{rdv.namespace}hosted"

    def found() -> bool:  # the host's key under the secret namespace; raises at a public value we cannot prove
        try:
            if store.check([hosted]):
                return True
            want = store.get(public).decode(errors="replace") if store.check([public]) else None
        except Exception as e:  # noqa: BLE001 - the store raises several types
            raise _gone(rdv, e, "checked the refit's secret") from e
        if want is not None and not hmac.compare_digest(want, rdv.proof("check")):
            n = int(store.add(f"reshard/{rdv.refit_id}/refused", 1))
            store.set(f"reshard/{rdv.refit_id}/refused/{n}", json.dumps(_me(role, process)))
            log.warning("refit %s: %s process %d presented a wrong secret; refused", rdv.refit_id, role, process)
            raise ExecutionError(f"refit {rdv.refit_id}: the secret this {role} process presented is not the "
                                 f"refit's; refused (it joins nothing and disturbs nothing)")
        return False

    if not poll(found, time.monotonic() + rdv.timeout, first_s=0.001):
        raise ExecutionError(f"refit {rdv.refit_id} is not hosted at {rdv.address} (nothing within "
                             f"{rdv.timeout:.0f} s)")


def refused(store: Any, rdv: Rendezvous) -> list[dict[str, Any]]:
    """The members refused for a wrong secret so far (for the host's logs)."""
    n = int(store.add(f"reshard/{rdv.refit_id}/refused", 0))
    return [json.loads(store.get(f"reshard/{rdv.refit_id}/refused/{i}")) for i in range(1, n + 1)]


def fail(store: Any, rdv: Rendezvous, reason: str) -> None:
    """Tell every member waiting in `join` that the refit cannot go on (the first reason stays)."""
    with contextlib.suppress(Exception):  # best effort: the store may be gone
        store.compare_set(f"{rdv.namespace}fail", "", reason.encode()[:4000])


def failure(store: Any, rdv: Rendezvous) -> str | None:
    """The first reason a member gave to `fail`, or None while none has."""
    key = f"{rdv.namespace}fail"
    return store.get(key).decode(errors="replace") if store.check([key]) else None


def _gone(rdv: Rendezvous, error: BaseException, doing: str) -> ExecutionError:
    """The error for a store that failed under a member: its host closed it after a failure, or died."""
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return ExecutionError(f"refit {rdv.refit_id}: the rendezvous store at {rdv.address} went away while this "
                          f"process {doing} (its host closed after a failure, or died): {first}")


def check_place(store: Any, rdv: Rendezvous, process: int) -> None:
    """Refuse (ExecutionError) a place another member already holds, before `join` claims it."""
    key = f"{rdv.namespace}member/{process}"
    if store.check([key]):
        raise _taken(rdv, process, store.get(key))


def _taken(rdv: Rendezvous, process: int, record: str | bytes) -> ExecutionError:
    other = json.loads(record)
    return ExecutionError(f"refit {rdv.refit_id}: place {process} is already taken by the {other.get('role')} "
                          f"process (pid {other.get('pid')} on {other.get('host')}): two members claim the same rank")


def join(store: Any, rdv: Rendezvous, process: int, size: int, role: str) -> dict[int, dict[str, Any]]:
    """Take place `process` of `size`, wait for every other member; each member's record (ExecutionError: refused)."""
    if not 0 <= process < size:
        raise ExecutionError(f"refit {rdv.refit_id}: process {process} is outside the refit's [0, {size})")
    members: dict[int, dict[str, Any]] = {}

    def all_joined() -> bool:  # a failure reported by a member wins, also once all have joined
        reason = failure(store, rdv)
        if reason is not None:
            raise ExecutionError(f"refit {rdv.refit_id}: another member failed: {reason}")
        for p in range(size):
            if p not in members and store.check([f"{rdv.namespace}member/{p}"]):
                members[p] = json.loads(store.get(f"{rdv.namespace}member/{p}"))
        return len(members) == size

    try:
        check_secret(store, rdv, role, process)
        mine = json.dumps(_me(role, process))
        got = store.compare_set(f"{rdv.namespace}member/{process}", "", mine)
        got = got.decode() if isinstance(got, bytes) else got
        if got != mine:
            raise _taken(rdv, process, got)
        joined = poll(all_joined, time.monotonic() + rdv.timeout, first_s=0.001)
    except ExecutionError:
        raise
    except (RuntimeError, OSError) as e:  # torch's DistNetworkError: the store's host (trainer process 0) is gone
        raise _gone(rdv, e, "waited to join") from None
    if not joined:
        missing = sorted(set(range(size)) - set(members))
        raise ExecutionError(f"refit {rdv.refit_id}: members {missing[:10]} of {size} did not join within "
                             f"{rdv.timeout:.0f} s")
    return members


__all__ = ["Rendezvous", "check_place", "connect", "fail", "failure", "host_store", "join", "refused", "scoped"]
