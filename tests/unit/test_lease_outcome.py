"""What the server logs when a driver's lease generation ends (adapters.vllm.lease): the middleware, driven by raw
ASGI messages over a recording engine, ends a generation after a clean refit and release, after a failed refit,
and after a lease that lapsed mid-update; its log line must say what it serves in each case (a clean release used to
log "previous weights kept" while the server served the new weights)."""
from __future__ import annotations

import asyncio
import json
import logging
import types

import pytest

from reshard.adapters.vllm.lease import Open, ReshardLeaseMiddleware, outcome

A = "a" * 32


class Engine:
    """The engine calls the middleware makes by itself when it ends a generation, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def finish_weight_update(self, version):
        self.calls.append(("finish", version))

    async def resume_generation(self):
        self.calls.append(("resume",))


def _app(failing: str | None):
    """The server's routes: 200, but 500 for the transfer of the update of version `failing`."""
    async def app(scope, receive, send):
        message = await receive()
        body = json.loads(message.get("body") or b"{}")
        update = body.get("update_info") or {} if isinstance(body, dict) else {}
        code = 500 if failing is not None and update.get("version") == failing and \
            update.get("phase") == "transfer" else 200
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
    await mw(scope, receive, send)
    return out["status"]


async def _refit(mw, version: str) -> None:
    """A driver's refit as TrainerSession makes it: pause, start, transfer, install, finish with the version (or,
    after a failed step, without one), resume."""
    await _request(mw, "/pause", {"mode": "wait"}, holder=A)
    await _request(mw, "/start_weight_update", {}, holder=A)
    ok = True
    for phase in ("transfer", "install"):
        status = await _request(mw, "/update_weights", {"update_info": {"version": version, "phase": phase}},
                                holder=A)
        ok = ok and status == 200
        if not ok:
            break
    await _request(mw, "/finish_weight_update", {"weight_version": version if ok else None}, holder=A)
    await _request(mw, "/resume", {}, holder=A)


def _closing_line(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.reshard.lease" and " closed (" in
             r.getMessage()]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("case", ["clean release", "failed refit, then release", "lapsed mid-update"])
def test_the_closing_log_line_says_what_the_server_serves(case, caplog):
    caplog.set_level(logging.INFO, logger="vllm.reshard.lease")

    async def main() -> list[tuple]:
        mw = ReshardLeaseMiddleware(_app("v1" if case.startswith("failed") else None), poll=0.02)
        mw.test_engine = Engine()
        ttl = 0.5 if case == "lapsed mid-update" else 60.0  # the others end by their release, not a lapse
        assert await _request(mw, "/reshard/lease", {"holder": A, "ttl": ttl}) == 200
        if case.startswith("failed"):
            await _refit(mw, "v0")  # a refit that succeeds, before the one that fails
        if case == "lapsed mid-update":
            await _refit(mw, "v1")
            await _request(mw, "/pause", {"mode": "wait"}, holder=A)
            await _request(mw, "/start_weight_update", {}, holder=A)
            await _request(mw, "/update_weights", {"update_info": {"version": "v2", "phase": "transfer"}}, holder=A)
            await asyncio.sleep(1.0)  # the driver dies: no renewal, the watchdog ends the lease
        else:
            await _refit(mw, "v1")
            await _request(mw, "/reshard/lease", {"holder": A, "release": True})
        return mw.test_engine.calls

    calls = asyncio.run(main())
    line = _closing_line(caplog)
    if case == "clean release":
        assert calls == []  # nothing was open: the middleware touched nothing
        assert "released by its holder" in line and "serving 'v1', the weights of its last refit" in line
        assert "previous weights kept" not in line
    elif case == "failed refit, then release":
        assert calls == []  # the driver closed its failed update and resumed
        assert "its last refit failed" in line and "previous weights kept (version 'v0'" in line
    else:
        assert calls == [("finish", None), ("resume",)]
        assert "its lease lapsed" in line and "closed without a version, previous weights kept" in line
        assert "(version 'v1'" in line and line.endswith("resumed")


def test_each_outcome_in_words():
    assert "rolled forward, finished as 'v3'" in outcome(Open(started=True, installed="v3"))
    assert outcome(Open()) == "nothing open and no refit finished: serving the weights it had before"
    assert outcome(Open(finished="v1", paused=True)).endswith("its last refit; resumed")
