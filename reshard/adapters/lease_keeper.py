"""The lease's wire, shared by both sides (`ROUTE`, `HEADER`, `request_body`), and the keeper: a process of its own
(standard library only) that renews a driver's lease on vLLM servers.

A driver takes the lease with `POST ROUTE {"holder": h, "ttl": s}`, renews it every ttl / 4, sends `HEADER: h`
with its refit calls, and ends it with `{"holder": h, "release": true}` (engine side: adapters.vllm.lease). A
process, not a thread, because a binding that holds the driver's GIL (NIXL, UCX set-up) must not starve the
renewals; the keeper stops when the driver dies (its pipe closes, or the keeper is re-parented) or is stopped.

Protocol (JSON lines): the driver writes on the keeper's stdin
    {"pid": driver pid, "holder": h, "ttl": s, "every": s}        first line
    {"add": {"url": "http://host:port", "api_key": key or null}}  a server granted since
and closes stdin to stop it; the keeper writes one line per round: {"errors": [...], "started": its start}
(errors empty: all renewed; started: time.monotonic() as the round began, one clock for every process).
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

ROUTE = "/reshard/lease"
HEADER = "X-Reshard-Lease"
MAX_LINE = 1 << 16


def request_body(holder: str, ttl: float | None = None, release: bool = False) -> dict[str, Any]:
    """A lease request: take or renew the lease for `ttl` seconds, or (`release`) end it."""
    return {"holder": holder, "release": True} if release else {"holder": holder, "ttl": ttl}


def driver_state(pid: int) -> str:
    """The driver's scheduler state: "gone", "stopped" (SIGSTOP, traced) or "running" (anything else)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]  # the command name, in parentheses, may hold spaces
    except FileNotFoundError:
        return "gone"
    except (OSError, IndexError):  # no /proc here: liveness only
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "gone"
        except PermissionError:
            pass
        return "running"
    return {"T": "stopped", "t": "stopped", "Z": "gone", "X": "gone"}.get(state, "running")


def request(url: str, route: str, body: Any = None, *, method: str = "POST", api_key: str | None = None,
            holder: str | None = None, timeout: float) -> str:
    """One JSON request to a vLLM server, carrying the lease `holder`; its answer's text (ConnectionError: a non-2xx
    answer, with the server's message, or the server unreachable)."""
    r = urllib.request.Request(url + route, data=None if body is None else json.dumps(body).encode(), method=method)
    r.add_header("Content-Type", "application/json")
    if api_key:
        r.add_header("Authorization", f"Bearer {api_key}")
    if holder:
        r.add_header(HEADER, holder)
    try:
        with urllib.request.urlopen(r, timeout=timeout) as response:
            return response.read().decode()
    except urllib.error.HTTPError as e:
        raise ConnectionError(f"{url}{route}: HTTP {e.code}: {_message(e.read().decode(errors='replace'))}") from None
    except OSError as e:  # (URLError too)
        raise ConnectionError(f"{url}{route}: {getattr(e, 'reason', e)}") from None


def _message(text: str) -> str:
    """The server's error message out of its JSON error body (FastAPI's "detail", vLLM's "error")."""
    try:
        body = json.loads(text)
    except ValueError:
        return text[:2000]
    if isinstance(body, dict):
        for key in ("error", "detail", "message"):
            value = body.get(key)
            if isinstance(value, dict):
                value = value.get("message", value)
            if value:
                return str(value)[:2000]
    return text[:2000]


def _server(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict) or not isinstance(value.get("url"), str) \
            or not value["url"].startswith(("http://", "https://")) \
            or not isinstance(value.get("api_key"), (str, type(None))):
        raise ValueError(f"not a server: {value!r}"[:200])
    return {"url": value["url"].rstrip("/"), "api_key": value.get("api_key")}


def _config(line: str) -> tuple[int, str, float, float]:
    value = json.loads(line)
    pid, holder, ttl, every = (value.get(k) if isinstance(value, dict) else None
                               for k in ("pid", "holder", "ttl", "every"))
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in (ttl, every))
    if not isinstance(pid, int) or pid <= 0 or not isinstance(holder, str) or not holder.isalnum() or not numbers:
        raise ValueError(f"bad keeper config: {line[:200]!r}")
    return pid, holder, float(ttl), float(every)


def main() -> int:
    """The keeper process: renew every `every` seconds until the driver is gone; exit status 0."""
    pid, holder, ttl, every = _config(sys.stdin.readline(MAX_LINE))
    parent = os.getppid()
    servers: list[dict[str, Any]] = []
    lock, stopped = threading.Lock(), threading.Event()

    def listen() -> None:  # the driver's later lines; EOF: the driver stopped us or died
        for line in iter(lambda: sys.stdin.readline(MAX_LINE), ""):
            try:
                server = _server(json.loads(line).get("add"))
            except (ValueError, AttributeError) as e:
                print(json.dumps({"errors": [f"lease keeper: {e}"]}), flush=True)
                continue
            with lock:
                servers.append(server)
        stopped.set()

    # The driver's state is read by a thread of its own: reading /proc/PID/stat can wait on the driver's memory
    # map lock, which a driver registering memory (NIXL, UCX) holds for seconds; a running driver must not go
    # unrenewed meanwhile, so the renewals go by the last state read.
    state = {"now": driver_state(pid)}

    def watch_driver() -> None:
        while not stopped.wait(min(every, 1.0)):
            state["now"] = driver_state(pid)

    threading.Thread(target=listen, daemon=True).start()
    threading.Thread(target=watch_driver, daemon=True).start()
    while not stopped.wait(every):
        if os.getppid() != parent:
            return 0  # re-parented: the driver died (a forked child of it may still hold the pipe open)
        if state["now"] == "gone":
            return 0
        if state["now"] == "stopped":
            continue  # a frozen driver's lease lapses
        started = time.monotonic()
        with lock:
            targets = list(servers)
        results: list[str | None] = [f"{t['url']}{ROUTE}: no answer within {ttl / 2:.0f} s" for t in targets]

        def one(k: int) -> None:  # one renewal: results[k] is None, or why it failed
            try:
                request(targets[k]["url"], ROUTE, request_body(holder, ttl), api_key=targets[k]["api_key"],
                        timeout=ttl / 2)
                results[k] = None
            except ConnectionError as e:
                results[k] = str(e)

        threads = [threading.Thread(target=one, args=(k,), daemon=True) for k in range(len(targets))]
        for t in threads:  # all at once: one slow server must not let the others' leases lapse
            t.start()
        for t in threads:
            t.join(ttl / 2 + 1.0)
        errors = [r for r in results if r]
        print(json.dumps({"errors": errors, "started": started}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
