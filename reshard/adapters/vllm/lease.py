"""The driver's lease on a vLLM server, held in the server's process: a dead or frozen driver cannot leave the
server paused or an update open. Start the server with `--middleware reshard.adapters.vllm.lease.
ReshardLeaseMiddleware` (it imports no vLLM). Protocol, JSON over the server's port:
  1. `POST /reshard/lease {"holder": h, "ttl": s}` takes or renews the lease; a new holder fences the previous one
     (a new generation), ending its open update first. `{"holder": h, "release": true}` ends it on purpose.
  2. The driver's RL calls (`FENCED`) carry `X-Reshard-Lease: h`; any holder but the current one gets HTTP 409.
     Calls without the header (an operator's) pass.
  3. A lapsed lease (no renewal within ttl; a holder's call inside the server keeps it, and its return leaves
     ttl / 2) fences the holder; once its calls returned, an update whose install succeeded is finished with its
     version (roll forward), any other update is finished without one (previous weights stay), a pause is resumed.
     The log says what is served then (`outcome`).
  4. Flip fence: an install that failed after it began writing live weights (its error names `TORN`) may leave a
     mix, so /resume and the generation routes (`GENERATE`) get HTTP 503 and the engine is paused until a later
     install succeeds on every worker. An install through the worker extension (`/collective_rpc` of
     `reshard_update`) counts the same.
`GET /reshard/lease` answers the holder, its generation and what it holds open. `LeaseBook` holds the rules,
`ReshardLeaseMiddleware` serves a vLLM server, `ThreadedLease` an engine called from threads (a Ray actor); the wire
is adapters.lease_keeper's, the driver side adapters.lease_renewal.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ...errors import ArgumentError, ExecutionError, ReshardError
from ...untrusted import parse_json
from ..lease_keeper import HEADER as _HEADER, ROUTE

HEADER = _HEADER.lower().encode()
FENCED = ("/pause", "/resume", "/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
          "/finish_weight_update", "/update_weight_version", "/collective_rpc")
WATCHED = ("/update_weights", "/collective_rpc")  # an operator's calls that may install: the flip fence watches them
GENERATE = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/inference/v1/generate", "/generate")
TORN = "the flip did not complete"  # in a worker's install error once it began writing live weights
MAX_TTL = 3600.0
MAX_BODY = 1 << 20
STALL = 1.0  # seconds a watchdog may oversleep before the gap counts as a stall of this process
log = logging.getLogger("vllm.reshard.lease")  # under vLLM's logger, so the server's log shows it


@dataclass
class Open:
    """What the current holder has open on the engine."""

    paused: bool = False
    started: bool = False
    installed: str | None = None  # the version an unfinished update installed
    pending: str | None = None  # the version an update in flight carries
    finished: str | None = None  # the version the holder's last finished update installed (what is served)
    failed: bool = False  # the holder's last update was closed without a version

    def enter(self, route: str, update: dict[str, Any] | None) -> None:
        """A call of the holder enters the engine."""
        if route == "/pause":
            self.paused = True
        elif route == "/start_weight_update":
            self.started, self.installed = True, None
        elif route == "/update_weights" and isinstance(update, dict):
            self.pending = str(update.get("version", ""))

    def leave(self, route: str, update: dict[str, Any] | None, ok: bool) -> None:
        """A call of the holder returned (`ok`: status 2xx); /finish_weight_update's `update` is {"version"}."""
        if route == "/resume" and ok:
            self.paused = False
        elif route == "/finish_weight_update":
            version = update.get("version") if isinstance(update, dict) else None
            if version is None:  # a failed refit's update closed (workers may refuse: ended all the same)
                self.failed = True
            elif ok:
                self.finished, self.failed = str(version), False
            self.started, self.installed = False, None
        elif installs(route, update):
            self.installed = self.pending if ok else None


def refit_call(route: str, body: bytes) -> tuple[str, dict[str, Any] | None]:
    """The route a call counts as and its update (None if unreadable); the worker extension's `reshard_update`
    through /collective_rpc counts as /update_weights."""
    try:
        payload = json.loads(body or b"{}") or {}
        if route == "/update_weights":
            return route, payload.get("update_info")
        if route == "/finish_weight_update":
            return route, {"version": payload.get("weight_version")}
        if route == "/collective_rpc" and payload.get("method") == "reshard_update":
            info = (payload.get("args") or [""])[0]
            return "/update_weights", json.loads(info) if info else {}  # (empty: transfer and install)
    except (ValueError, AttributeError, TypeError, IndexError, RecursionError):  # (deep nesting: unreadable too)
        pass
    return route, None


def installs(route: str, update: dict[str, Any] | None) -> bool:
    """Whether a call writes the live weights (an install phase, or a one-phase update)."""
    return route == "/update_weights" and isinstance(update, dict) and update.get("phase", "all") in ("install", "all")


@dataclass
class LeaseBook:
    """The lease's state and rules, without I/O (the middleware does the engine calls). `clock` is monotonic."""

    clock: Callable[[], float] = time.monotonic
    holder: str | None = None
    expires: float = 0.0
    generation: int = 0
    open: Open = field(default_factory=Open)
    inflight: int = 0  # calls of lease holders (any generation) inside the server now
    fenced: list[str] = field(default_factory=list)  # the last 64 holders whose generation ended
    ttl: float = 0.0  # the holder's lease, as last granted
    calls: int = 0  # the current holder's calls inside the server now
    torn: str | None = None  # the version whose install failed partway (the engine is fenced)

    def lapsed(self) -> bool:
        """The holder went silent for its lease; never while one of its calls is inside the server (a busy engine
        may starve its renewals)."""
        return self.holder is not None and self.calls == 0 and self.clock() > self.expires

    def woke(self, slept: float, meant: float) -> bool:
        """The watchdog slept `slept` seconds where it meant `meant`; True for a stall of this process (renewals
        waited unheard), whose time is then not counted against the holder."""
        stall = slept - meant
        if stall <= STALL:
            return False
        if self.holder is not None:
            self.expires += stall
        return True

    def grant(self, holder: str, ttl: float) -> bool:
        """Take or renew the lease; True for a new generation (the caller ended the previous one first).

        Raises:
            ValueError: the holder's generation ended (it must init again).
        """
        self._check_live(holder)
        new = holder != self.holder
        if new:
            self.holder, self.generation, self.open, self.calls = holder, self.generation + 1, Open(), 0
        self.expires, self.ttl = self.clock() + ttl, ttl
        return new

    def _check_live(self, holder: str) -> None:
        if holder in self.fenced:
            raise ValueError(f"lease {holder[:16]!r} ended (its generation was fenced): init again")

    def fence(self) -> Open:
        """End the holder's generation (its later calls are refused); returns what it left open."""
        if self.holder is not None:
            self.fenced = [*self.fenced[-63:], self.holder]
        left, self.holder, self.open, self.calls = self.open, None, Open(), 0
        return left

    def due(self, slept: float, meant: float) -> bool:
        """A watchdog's round (see `woke`): True if the holder's lease lapsed and its generation must end now."""
        return not self.woke(slept, meant) and self.lapsed()

    def ending(self, holder: str, release: bool) -> str | None:
        """Why the current generation ends before a lease request of `holder` is answered (None: it goes on).

        Raises:
            ValueError: a renewal of a holder whose generation was fenced (it must init again).
        """
        if release:
            return "released by its holder" if holder == self.holder else None
        self._check_live(holder)
        return "a new driver took the lease" if self.holder is not None and holder != self.holder else None

    def enter(self, holder: str | None, route: str, update: dict[str, Any] | None) -> Open:
        """A call of `holder` (None: an operator's) enters the engine; returns the Open it books on (the one a
        fence hands over, so the recovery sees the call's outcome)."""
        opened = self.open
        opened.enter(route, update)
        self.inflight += 1
        if holder is not None and holder == self.holder:
            self.calls += 1
        return opened

    def leave(self, holder: str | None, opened: Open, route: str, update: dict[str, Any] | None, ok: bool) -> None:
        """The call `enter` booked returned; a current holder then has half its lease to be heard again."""
        opened.leave(route, update, ok)
        self.inflight -= 1
        if holder is not None and holder == self.holder and self.calls > 0:
            self.calls -= 1
            self.expires = max(self.expires, self.clock() + self.ttl / 2)

    def state(self) -> dict[str, Any]:
        """The current holder, its generation, what it holds open, the calls inside and a torn flip's version (JSON)."""
        return {"holder": self.holder, "generation": self.generation, "open": self.open.__dict__,
                "inflight": self.inflight, "torn": self.torn}

    def flipped(self, route: str, update: dict[str, Any] | None, ok: bool, error: str) -> None:
        """A call returned: an install that failed partway (`error` names TORN) fences the engine, one that
        succeeded lifts the fence."""
        if installs(route, update) and (ok or TORN in error):
            self.torn = None if ok else str(update.get("version", ""))

    def closed(self, route: str) -> str | None:
        """Why `route` is refused while a torn flip fences the engine (resuming or generating), or None."""
        if self.torn is None or route not in ("/resume", *GENERATE):
            return None
        return (f"refused: {TORN} (version {self.torn!r} is installed on some workers of this engine, not all), so "
                f"the engine serves nothing until a refit's install succeeds on every worker")

    def refusal(self, holder: str | None) -> str | None:
        """Why a call of `holder` is refused (it is not the current, live holder), or None (None: an operator's)."""
        if holder is None or holder == self.holder and not self.lapsed():
            return None
        now = f"the current holder is generation {self.generation}" if self.holder else "no driver holds it now"
        return (f"refused: lease {holder[:16]!r} is not the server's current lease ({now}); a late call of an old "
                f"generation is never applied")


def outcome(left: Open) -> str:
    """What the server serves once a generation ended and what it left open was closed, in words for the log."""
    kept = f" (version {left.finished!r}, its last finished refit)" if left.finished is not None else ""
    if left.started and left.installed is not None:
        what = f"its open update had installed {left.installed!r}: rolled forward, finished as {left.installed!r}"
    elif left.started:
        what = f"its open update installed nothing: closed without a version, previous weights kept{kept}"
    elif left.failed:
        what = f"nothing open; its last refit failed and was closed without a version: previous weights kept{kept}"
    elif left.finished is not None:
        what = f"nothing open: serving {left.finished!r}, the weights of its last refit"
    else:
        what = "nothing open and no refit finished: serving the weights it had before"
    return what + ("; resumed" if left.paused else "")


def parse_grant(body: bytes) -> tuple[str, float, bool]:
    """The lease request's fields, validated (untrusted input); ArgumentError names what is wrong."""
    if not isinstance(body, (bytes, bytearray)) or len(body) > MAX_BODY:
        raise ArgumentError("body", body, f"must be at most {MAX_BODY} bytes of JSON")
    # the package's one strict reader: repeated keys, NaN and deep nesting are refused as well as broken JSON
    value = parse_json(bytes(body) or b"{}", ArgumentError, "body", bytes(body[:200]))
    if not isinstance(value, dict):
        raise ArgumentError("body", value, "must be a JSON object")
    unknown = sorted(set(value) - {"holder", "ttl", "release"})
    holder, ttl, release = value.get("holder"), value.get("ttl", 30.0), value.get("release", False)
    if unknown:
        raise ArgumentError("body", unknown, "has unknown fields; known: ['holder', 'release', 'ttl']")
    if not isinstance(holder, str) or not 8 <= len(holder) <= 128 or not holder.isalnum():
        raise ArgumentError("holder", holder, "must be 8-128 letters or digits")
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) \
            or not 0.5 <= ttl <= MAX_TTL:
        raise ArgumentError("ttl", ttl, f"must be a number of seconds in [0.5, {MAX_TTL:.0f}]")
    if not isinstance(release, bool):
        raise ArgumentError("release", release, "must be true or false")
    return holder, float(ttl), release


def _fence(book: LeaseBook, why: str) -> tuple[int, Open]:
    """Fence the holder; its generation and what it left open (its calls still inside fill it in)."""
    generation, holder, left = book.generation, book.holder, book.fence()
    log.warning("reshard: lease generation %d (%s) ended: %s", generation, holder, why)
    return generation, left


def _granted(book: LeaseBook, holder: str, ttl: float, release: bool) -> dict[str, Any]:
    """A lease request's answer, once the generation it ends was closed."""
    if release:
        return {"released": True}
    book.grant(holder, ttl)
    return {"holder": holder, "generation": book.generation, "ttl": ttl}


def _closing(left: Open, torn: str | None) -> list[tuple[str, tuple]]:
    """The engine calls that close what a fenced generation left open: its update finished with the version its
    install carried (None: without one), its pause resumed (not while a torn flip fences the engine)."""
    resume = left.paused and torn is None
    return [("finish_weight_update", (left.installed,))] * left.started + [("resume_generation", ())] * resume


class ReshardLeaseMiddleware:
    """ASGI middleware (vLLM's `--middleware`): keeps the LeaseBook, fences the RL routes, recovers a lapsed lease."""

    def __init__(self, app: Any, poll: float = 0.2) -> None:
        self.app, self.poll = app, poll
        self.book = LeaseBook()
        self.lock: asyncio.Lock | None = None
        self.idle: asyncio.Event | None = None
        self.engine: Any = None
        self.watchdog: asyncio.Task | None = None
        self.paused_by_fence = False  # a torn flip paused an engine its driver had not

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        self._start(scope)
        path = scope.get("path", "")
        if path == ROUTE:
            return await self._lease(scope, receive, send)
        closed = self.book.closed(path)
        if closed is not None:
            return await _answer(send, 503, {"error": closed})
        holder = _header(scope, HEADER)
        if path not in FENCED or (holder is None and path not in WATCHED):
            return await self.app(scope, receive, send)
        refusal = self.book.refusal(holder)
        if refusal is not None:
            return await _answer(send, 409, {"error": refusal})
        body, receive = await _buffered(receive)
        path, update = refit_call(path, body)
        opened = self.book.enter(holder, path, update) if holder is not None else None
        if opened is not None:
            self.idle.clear()
        status, error = {"code": 500}, bytearray()

        async def watch(message: dict) -> None:
            if message.get("type") == "http.response.start":
                status["code"] = int(message.get("status", 500))
            elif status["code"] >= 300 and len(error) < MAX_BODY:  # a failure's answer: does it name TORN?
                error.extend(message.get("body", b""))
            try:
                await send(message)
            except Exception:  # noqa: BLE001 - the driver went away: the outcome still counts
                pass

        try:
            await self.app(scope, receive, watch)
        except Exception as e:  # an engine error the app did not answer (vLLM's RL routes): the server's 500
            error.extend(str(e).encode())
            raise
        finally:
            was, ok = self.book.torn, 200 <= status["code"] < 300
            self.book.flipped(path, update, ok, error.decode(errors="replace"))
            if opened is not None:
                self.book.leave(holder, opened, path, update, ok)
            if self.book.inflight <= 0:
                self.idle.set()
            if (self.book.torn is None) != (was is None):
                await self._fence_flip(was)

    async def _fence_flip(self, was: str | None) -> None:
        """A flip tore: pause the engine (aborting what runs on the mix) unless paused; the fence lifted: resume
        it if the fence paused it."""
        try:
            if was is None:
                log.error("reshard: %s (version %r): the engine is fenced until a refit lands whole", TORN,
                          self.book.torn)
                self.paused_by_fence = not await self.engine.is_paused()
                if self.paused_by_fence:
                    await self.engine.pause_generation(mode="abort")
            elif self.paused_by_fence:
                self.paused_by_fence = False
                await self.engine.resume_generation()
        except Exception:  # noqa: BLE001 - the routes stay refused (or open) all the same
            log.exception("reshard: pausing or resuming the engine around a torn flip failed")

    def _start(self, scope: dict) -> None:
        if self.watchdog is None:
            self.lock, self.idle = asyncio.Lock(), asyncio.Event()
            self.idle.set()
            self.engine = scope["app"].state.engine_client
            self.watchdog = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        clock = self.book.clock
        while True:
            went = clock()
            await asyncio.sleep(self.poll)
            if self.book.due(clock() - went, self.poll):
                async with self.lock:
                    if self.book.lapsed():
                        try:
                            await self._end("its lease lapsed")
                        except Exception:  # noqa: BLE001 - keep watching; the next driver's lease ends it again
                            log.exception("reshard: ending a lapsed lease failed")

    async def _end(self, why: str) -> None:
        """Fence the holder, wait for its calls inside the server, then close what it left open."""
        generation, left = _fence(self.book, why)
        await self.idle.wait()  # the calls already inside the server have returned (their outcome is in `left`)
        for method, args in _closing(left, self.book.torn):
            try:
                await getattr(self.engine, method)(*args)
            except Exception as e:  # noqa: BLE001 - workers whose update already closed refuse; expected
                if method != "finish_weight_update":
                    raise
                log.info("reshard: closing the update of generation %d: %s", generation, e)
        log.warning("reshard: generation %d closed (%s): %s", generation, why, outcome(left))

    async def _lease(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("method") == "GET":
            return await _answer(send, 200, self.book.state())
        body, _ = await _buffered(receive)
        try:
            holder, ttl, release = parse_grant(body)
        except ReshardError as e:
            return await _answer(send, 400, {"error": str(e)})
        async with self.lock:
            try:
                why = self.book.ending(holder, release)
            except ValueError as e:
                return await _answer(send, 409, {"error": str(e)})
            if why is not None:
                await self._end(why)
            return await _answer(send, 200, _granted(self.book, holder, ttl, release))


class ThreadedLease:
    """The lease of an engine whose calls come on threads (a Ray engine actor): the LeaseBook's rules, a watchdog
    thread, and `call`, which fences and books each refit call.

    Args:
        engine: returns the client whose calls close a lapsed holder's update.
        engine_lock: held around every engine call; the recovery waits for it.
        poll: seconds between the watchdog's looks.
    """

    def __init__(self, engine: Callable[[], Any], engine_lock: Any, poll: float = 0.2) -> None:
        self.engine, self.engine_lock, self.poll = engine, engine_lock, poll
        self.book = LeaseBook()
        self.lock = threading.Lock()
        threading.Thread(target=self._watch, daemon=True, name="reshard-lease").start()

    def request(self, body: bytes) -> dict[str, Any]:
        """A lease request (the JSON body of `POST /reshard/lease`): its answer.

        Raises:
            ArgumentError: a malformed request.
            ExecutionError: a renewal of a holder whose generation ended.
        """
        holder, ttl, release = parse_grant(body)
        with self.lock:
            try:
                why = self.book.ending(holder, release)
            except ValueError as e:
                raise ExecutionError(str(e)) from None
            if why is not None:
                self._end(why)
            return _granted(self.book, holder, ttl, release)

    def call(self, route: str, holder: str | None, fn: Callable[[], Any], update: Any = None) -> Any:
        """`fn()` as the refit call `route` of `holder` (None: an operator's), booked.

        Raises:
            ExecutionError: `holder` does not hold the lease.
        """
        with self.lock:
            refusal = self.book.refusal(holder)
            if refusal is not None:
                raise ExecutionError(refusal)
            opened = self.book.enter(holder, route, update)
        ok, error = False, ""
        with self.engine_lock:  # booked under it: a recovery waiting for the lock sees the call's outcome
            try:
                value = fn()
                ok = True
                return value
            except Exception as e:
                error = str(e)
                raise
            finally:
                self.book.flipped(route, update, ok, error)
                self.book.leave(holder, opened, route, update, ok)

    def _watch(self) -> None:
        clock = self.book.clock
        while True:
            went = clock()
            time.sleep(self.poll)
            with self.lock:
                if self.book.due(clock() - went, self.poll):
                    self._end("its lease lapsed")

    def _end(self, why: str) -> None:
        """Fence the holder (self.lock held); once its call in progress returned, close what it left open."""
        generation, left = _fence(self.book, why)
        with self.engine_lock:  # the holder's call in progress returns first
            for method, args in _closing(left, self.book.torn):
                try:
                    getattr(self.engine(), method)(*args)
                except Exception as e:  # noqa: BLE001 - an update that already closed refuses; expected
                    log.info("reshard: closing the update of generation %d: %s", generation, e)
        log.warning("reshard: generation %d closed (%s): %s", generation, why, outcome(left))


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _buffered(receive: Any) -> tuple[bytes, Any]:
    """The request's body (bounded) and a `receive` that hands it to the app again."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message.get("type") != "http.request":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            break
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    body, sent = b"".join(chunks), {"done": False}

    async def replay() -> dict:
        if not sent["done"]:
            sent["done"] = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return body, replay


async def _answer(send: Any, code: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": code,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


__all__ = ["FENCED", "HEADER", "LeaseBook", "Open", "ReshardLeaseMiddleware", "ThreadedLease", "outcome", "parse_grant",
           "refit_call"]
