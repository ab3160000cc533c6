"""The driver's lease (adapters.vllm.lease) as pure logic: the book's rules, and the ASGI middleware driven by raw
ASGI messages over a recording engine (the real server test is tests/integration/serve/test_driver_death.py)."""
from __future__ import annotations

import asyncio
import json
import types

import pytest

from reshard.adapters.vllm.lease import LeaseBook, ReshardLeaseMiddleware, parse_grant
from reshard.errors import ArgumentError


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_book_grants_renews_fences_and_refuses_old_generations():
    clock = Clock()
    book = LeaseBook(clock=clock)
    assert book.grant("a" * 8, 5.0) and book.generation == 1
    assert not book.grant("a" * 8, 5.0) and book.generation == 1  # a renewal
    assert book.refusal("a" * 8) is None and "not the server's current lease" in book.refusal("b" * 8)
    clock.t = 5.5
    assert book.lapsed() and book.refusal("a" * 8) is not None  # a lapsed holder is refused before the watchdog
    book.fence()
    assert book.holder is None and not book.lapsed()
    with pytest.raises(ValueError, match="init again"):  # a fenced driver that thaws does not come back
        book.grant("a" * 8, 5.0)
    assert book.grant("b" * 8, 5.0) and book.generation == 2


def test_a_stall_of_the_engines_own_process_is_not_counted_against_the_holder():
    """A watchdog that overslept (the engine's loop or GIL held) gives the holder that time back: renewals sent
    meanwhile were waiting unheard; a normal oversleep counts."""
    clock = Clock()
    book = LeaseBook(clock=clock)
    book.grant("a" * 8, 5.0)
    assert not book.woke(0.2 + 0.5, 0.2) and book.expires == 5.0  # jitter: counted
    clock.t = 12.0
    assert book.woke(12.0, 0.2) and not book.lapsed()  # a 12 s stall: the lease had 5 s of hearing, not 12
    clock.t = 12.0 + 5.0 - 0.2 + 0.1
    assert book.lapsed()  # and lapses once the holder stays silent while the server hears
    assert LeaseBook(clock=clock).woke(10.0, 0.2)  # no holder: nothing to give back


def test_a_call_of_the_holder_inside_the_server_keeps_its_lease():
    """A holder whose call the engine is still busy with (a long init) is alive, its renewals maybe starved: no
    lapse while the call is inside, half a lease to be heard again after it returns, then the normal rule."""
    clock = Clock()
    book = LeaseBook(clock=clock)
    book.grant("a" * 8, 20.0)
    call = lambda holder: (holder, book.enter(holder, "/init_weight_transfer_engine", None))  # noqa: E731
    leave = lambda holder, opened: book.leave(holder, opened, "/init_weight_transfer_engine", None, True)  # noqa: E731
    a = call("a" * 8)
    clock.t = 64.0  # the call took a minute, and no renewal came
    assert not book.lapsed() and book.refusal("a" * 8) is None
    leave(*call("b" * 8))  # another holder's call (let in by no rule here) keeps nothing
    leave(*a)
    clock.t = 64.0 + 9.9
    assert not book.lapsed()  # its next call or renewal has ttl / 2 to arrive
    clock.t = 64.0 + 10.1
    assert book.lapsed()
    book.fence()
    assert book.calls == 0 and not book.lapsed()
    assert book.grant("c" * 8, 20.0) and book.calls == 0
    leave("c" * 8, book.open)  # a return without an entry (a call of the fenced generation) changes nothing
    assert book.expires == 64.0 + 10.1 + 20.0


@pytest.mark.parametrize("body,rule", [
    (b"[]", "JSON object"), (b"nope", "not valid JSON"), ("{}", "bytes"), (b'{"holder": "short"}', "8-128"),
    (b'{"holder": "abcdefgh", "ttl": 0}', "ttl"), (b'{"holder": "abcdefgh", "ttl": true}', "ttl"),
    (b'{"holder": "abcdefgh", "ttl": "5"}', "ttl"), (b'{"holder": "abcdefgh", "ttl": NaN}', "NaN"),
    (b'{"holder": "abcdefgh", "x": 1}', "unknown fields"), (b'{"holder": "abc/../defgh"}', "letters or digits"),
    # which holder a repeated key names depends on the parser; nesting past the interpreter's recursion limit raised
    # RecursionError (not a refusal) before the lease read its body with the package's strict JSON reader
    (b'{"holder": "abcdefgh1", "holder": "abcdefgh2"}', "repeats the key 'holder'"), (b"[" * 200_000, "nests deeper")])
def test_bad_lease_requests_are_refused(body, rule):
    with pytest.raises(ArgumentError, match=rule):
        parse_grant(body)


class Engine:
    """Records the engine calls the middleware makes; `update` answers an /update_weights with this status."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def finish_weight_update(self, version):
        self.calls.append(("finish", version))

    async def resume_generation(self):
        self.calls.append(("resume",))

    async def is_paused(self):
        return bool(self.calls) and self.calls[-1][0] == "pause"

    async def pause_generation(self, mode):
        self.calls.append(("pause", mode))


def _app(statuses: dict[str, int], gate: dict[str, asyncio.Event]):
    async def app(scope, receive, send):
        message = await receive()
        assert message["type"] == "http.request"  # the middleware replays the body it read
        if scope["path"] in gate:
            await gate[scope["path"]].wait()
        code = statuses.get(scope["path"], 200)
        await send({"type": "http.response.start", "status": code, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})
    return app


async def _request(mw, path, body=None, holder=None, method="POST"):
    headers = [(b"x-reshard-lease", holder.encode())] if holder else []
    scope = {"type": "http", "path": path, "method": method, "headers": headers,
             "app": types.SimpleNamespace(state=types.SimpleNamespace(engine_client=mw.test_engine))}
    data = json.dumps(body).encode() if body is not None else b""
    out = {}

    async def receive():
        return {"type": "http.request", "body": data, "more_body": False}

    async def send(message):
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
        else:
            out["body"] = message.get("body", b"")
    await mw(scope, receive, send)
    return out["status"], json.loads(out.get("body") or b"{}")


def _middleware(statuses=None, gate=None):
    mw = ReshardLeaseMiddleware(_app(statuses or {}, gate or {}), poll=0.02)
    mw.test_engine = Engine()
    return mw


def _run(coro):
    return asyncio.run(coro)


A, B = "a" * 32, "b" * 32


@pytest.mark.parametrize("installed,expected", [(False, None), (True, "v1")])
def test_a_lapsed_lease_ends_the_update_and_resumes(installed, expected):
    async def main():
        mw = _middleware()
        assert (await _request(mw, "/reshard/lease", {"holder": A, "ttl": 0.5}))[0] == 200
        await _request(mw, "/pause", holder=A)
        await _request(mw, "/start_weight_update", holder=A)
        await _request(mw, "/update_weights", {"update_info": {"version": "v1", "phase": "transfer"}}, holder=A)
        if installed:
            await _request(mw, "/update_weights", {"update_info": {"version": "v1", "phase": "install"}}, holder=A)
        await asyncio.sleep(0.8)  # no renewal: the lease lapses, the watchdog ends it
        assert mw.test_engine.calls == [("finish", expected), ("resume",)]
        status, body = await _request(mw, "/finish_weight_update", holder=A)  # a late call of the dead driver
        assert status == 409 and "never applied" in body["error"]
        assert (await _request(mw, "/reshard/lease", method="GET"))[1]["holder"] is None
        assert (await _request(mw, "/reshard/lease", {"holder": A, "ttl": 5}))[0] == 409  # no renewal after it
    _run(main())


def test_a_failed_install_rolls_back():
    async def main():
        mw = _middleware({"/update_weights": 500})
        await _request(mw, "/reshard/lease", {"holder": A, "ttl": 0.5})
        await _request(mw, "/start_weight_update", holder=A)
        await _request(mw, "/update_weights", {"update_info": {"version": "v1", "phase": "install"}}, holder=A)
        await asyncio.sleep(0.8)
        assert mw.test_engine.calls == [("finish", None)]
    _run(main())


def test_a_new_driver_takes_over_after_the_old_ones_calls_return():
    async def main():
        gate = {"/update_weights": asyncio.Event()}
        mw = _middleware(gate=gate)
        await _request(mw, "/reshard/lease", {"holder": A, "ttl": 60})
        await _request(mw, "/pause", holder=A)
        await _request(mw, "/start_weight_update", holder=A)
        stuck = asyncio.create_task(_request(mw, "/update_weights", {"update_info": {"version": "v1"}}, holder=A))
        await asyncio.sleep(0.05)
        takeover = asyncio.create_task(_request(mw, "/reshard/lease", {"holder": B, "ttl": 60}))
        await asyncio.sleep(0.1)
        assert not takeover.done() and mw.test_engine.calls == []  # waits for the old update inside the server
        gate["/update_weights"].set()
        assert (await stuck)[0] == 200 and (await takeover)[1]["generation"] == 2
        assert mw.test_engine.calls == [("finish", "v1"), ("resume",)]  # the old update had installed: forward
        assert (await _request(mw, "/start_weight_update", holder=A))[0] == 409
        assert (await _request(mw, "/start_weight_update", holder=B))[0] == 200
        assert (await _request(mw, "/resume"))[0] == 200  # calls without a lease pass untouched
        await _request(mw, "/reshard/lease", {"holder": B, "release": True})
        assert mw.test_engine.calls[-1] == ("finish", None)
    _run(main())


class SyncEngine:
    """The engine client a ThreadedLease closes a lapsed update with (a Ray actor's), recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def finish_weight_update(self, version):
        self.calls.append(("finish", version))


def test_the_threaded_lease_keeps_the_same_rules():
    """The Ray actor's lease (ThreadedLease): the same book as the server's: calls of another holder refused, a
    holder's call inside keeps its lease, a lapse closes the update it left open (forward when its install
    succeeded), a fenced holder cannot come back, a new holder's grant ends the previous generation first."""
    import threading
    import time

    from reshard.adapters.vllm.lease import ThreadedLease
    from reshard.errors import ExecutionError
    from reshard.polling import poll

    engine = SyncEngine()
    lease = ThreadedLease(lambda: engine, threading.RLock(), poll=0.02)
    grant = lambda holder, ttl=0.5, release=False: lease.request(  # noqa: E731
        json.dumps({"holder": holder, **({"release": True} if release else {"ttl": ttl})}).encode())
    assert grant(A)["generation"] == 1
    with pytest.raises(ExecutionError, match="never applied"):
        lease.call("/start_weight_update", B, lambda: None)
    lease.call("/start_weight_update", A, lambda: None)
    lease.call("/update_weights", A, lambda: time.sleep(0.8), {"version": "v1", "phase": "install"})
    assert engine.calls == []  # the call outlasted the lease: inside, it kept it
    # then no renewal: the watchdog ends the generation, rolling the installed update forward
    assert poll(lambda: bool(engine.calls), time.monotonic() + 10.0)
    assert engine.calls == [("finish", "v1")] and lease.book.state()["holder"] is None
    with pytest.raises(ExecutionError, match="init again"):
        grant(A)
    assert grant(B, 60)["generation"] == 2
    lease.call("/start_weight_update", B, lambda: None)
    assert grant(A * 2, 60)["generation"] == 3  # a new driver: the open update (nothing installed) closed first
    assert engine.calls[-1] == ("finish", None)
    assert grant(A * 2, release=True) == {"released": True} and lease.book.holder is None


def test_a_torn_flip_fences_generation_and_resume_until_an_install_succeeds():
    """LeaseBook.flipped / closed, the rule the server's middleware and the Ray engine actor both apply: an install
    that failed after it began writing live weights (its error names TORN) fences the engine; a failure before any
    write (no TORN) or a call that installs nothing leaves it serving; the next successful install lifts it."""
    from reshard.adapters.vllm.lease import TORN

    book = LeaseBook()
    install = {"version": "a", "phase": "install"}
    book.flipped("/update_weights", install, False, "install refused: version a did not land whole")
    assert book.torn is None and book.closed("/v1/completions") is None  # refused before any write: serving
    book.flipped("/update_weights", install, False, f"{TORN} on engine replica 0 rank 1: boom")
    assert book.torn == "a"
    for route in ("/resume", "/v1/completions", "/generate"):
        assert "'a'" in book.closed(route) and TORN in book.closed(route)
    assert book.closed("/pause") is None and book.closed("/update_weights") is None  # the way out stays open
    book.flipped("/update_weights", {"version": "b", "phase": "transfer"}, True, "")  # no install: still fenced
    assert book.torn == "a"
    book.flipped("/update_weights", {"version": "b", "phase": "install"}, True, "")
    assert book.torn is None and book.closed("/resume") is None


def test_an_install_through_the_worker_extension_is_fenced_the_same_way():
    """server.ExtensionClient installs with /collective_rpc of `reshard_update` (an operator's call, no lease): the
    middleware reads it as the /update_weights it stands for (lease.refit_call), so a torn one fences generation and
    a whole one lifts the fence; other collective_rpc calls and unreadable bodies install nothing."""
    from reshard.adapters.vllm.lease import TORN, refit_call

    def rpc(info, method="reshard_update"):
        return {"method": method, "args": [json.dumps(info)] if info is not None else []}

    assert refit_call("/collective_rpc", json.dumps(rpc({"version": "a", "phase": "install"})).encode()) == \
        ("/update_weights", {"version": "a", "phase": "install"})
    assert refit_call("/collective_rpc", json.dumps(rpc(None)).encode()) == ("/update_weights", {})  # one phase
    for body in (rpc({"phase": "install"}, "reshard_in_flight"), {"method": "reshard_update", "args": [7]}, "x"):
        assert refit_call("/collective_rpc", json.dumps(body).encode()) == ("/collective_rpc", None)
    assert refit_call("/collective_rpc", b"{not json") == ("/collective_rpc", None)
    assert refit_call("/update_weights", b"[" * 200_000) == ("/update_weights", None)  # nesting: unreadable too

    outcome = {"code": 500}

    async def app(scope, receive, send):  # the workers' install fails, naming TORN, while outcome says 500
        await receive()
        code = outcome["code"] if scope["path"] == "/collective_rpc" else 200
        error = {"error": f"Worker failed with error '{TORN} on engine replica 0 rank 1'"} if code == 500 else {}
        await send({"type": "http.response.start", "status": code, "headers": []})
        await send({"type": "http.response.body", "body": json.dumps(error).encode()})

    async def main():
        mw = ReshardLeaseMiddleware(app, poll=0.02)
        mw.test_engine = Engine()
        assert (await _request(mw, "/collective_rpc", rpc({"version": "a", "phase": "transfer"})))[0] == 500
        assert mw.book.torn is None  # a transfer writes no live weights
        await _request(mw, "/collective_rpc", rpc({"version": "a", "phase": "install"}))
        assert mw.book.torn == "a"
        status, body = await _request(mw, "/v1/completions", {"prompt": [1]})
        assert status == 503 and TORN in body["error"] and ("pause", "abort") in mw.test_engine.calls
        outcome["code"] = 200
        await _request(mw, "/collective_rpc", rpc({"version": "b", "phase": "install"}))
        assert mw.book.torn is None and (await _request(mw, "/v1/completions", {"prompt": [1]}))[0] == 200
        assert mw.test_engine.calls[-1] == ("resume",)
    _run(main())
