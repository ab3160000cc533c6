"""The driver's side of the lease (engines.Leased): taken on every engine that keeps one, renewed while the driver
lives (`LeaseRenewal`), released at the end; and the lease's wire, shared with the engine side
(adapters.vllm.lease): `ROUTE`, `HEADER`, `request_body`.

A driver takes the lease with `POST ROUTE {"holder": h, "ttl": s}`, renews it every ttl / 4, sends `HEADER: h`
with its refit calls, and ends it with `{"holder": h, "release": true}`. Servers are renewed by the keeper: this
file run as a script (`main`, standard library only), a process of its own, because a binding that holds the
driver's GIL (NIXL, UCX set-up) must not starve the renewals; the keeper stops when the driver dies (its pipe closes,
or the keeper is re-parented) or is stopped. Other engines (Ray actors) are renewed by a thread.

The keeper's protocol (JSON lines): the driver writes on the keeper's stdin
    {"pid": driver pid, "holder": h, "ttl": s, "every": s}        first line
    {"add": {"url": "http://host:port", "api_key": key or null}}  a server granted since
and closes stdin to stop it; the keeper writes one line per round: {"errors": [...], "started": its start}
(errors empty: all renewed; started: time.monotonic() as the round began, one clock for every process).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

if __name__ != "__main__":  # (the keeper, run as a script, imports nothing of reshard)
    from .engines import EngineCall, Leased, wait_calls

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


def renew(server: dict[str, Any], holder: str, ttl: float) -> str | None:
    """One renewal; None, or why it failed."""
    request = urllib.request.Request(server["url"] + ROUTE, method="POST",
                                     data=json.dumps(request_body(holder, ttl)).encode())
    request.add_header("Content-Type", "application/json")
    if server.get("api_key"):
        request.add_header("Authorization", f"Bearer {server['api_key']}")
    try:
        with urllib.request.urlopen(request, timeout=ttl / 2) as response:
            response.read()
    except urllib.error.HTTPError as e:
        return f"{server['url']}{ROUTE}: HTTP {e.code}: {e.read(2000).decode(errors='replace')}"
    except (urllib.error.URLError, OSError) as e:
        return f"{server['url']}{ROUTE}: {getattr(e, 'reason', e)}"
    return None


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

        def one(k: int) -> None:
            results[k] = renew(targets[k], holder, ttl)

        threads = [threading.Thread(target=one, args=(k,), daemon=True) for k in range(len(targets))]
        for t in threads:  # all at once: one slow server must not let the others' leases lapse
            t.start()
        for t in threads:
            t.join(ttl / 2 + 1.0)
        errors = [r for r in results if r]
        print(json.dumps({"errors": errors, "started": started}), flush=True)
    return 0


class LeaseRenewal:
    """Renews the driver's lease every ttl / 4 s (servers by a keeper process, others by a thread)."""

    def __init__(self, engines: list[Any], holder: str, ttl: float) -> None:
        self.engines: list[Any] = []  # renewed by the thread
        self.granted: list[Any] = []  # every engine renewed
        self.holder, self.ttl = holder, ttl
        # per renewer: its last round's failure (None: renewed), and when its last renewed round began (a grant at
        # or after it: the lease holds until then + ttl); taken from now, before the first grant
        self.failures: dict[str, str | None] = {"thread": None, "keeper": None}
        self.renewed = dict.fromkeys(self.failures, time.monotonic())
        self.keeper: Any = None
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="reshard-lease")
        self.thread.start()
        for engine in engines:
            self.add(engine)

    def take(self, engines: list[Any], timeout: float) -> None:
        """Take the lease on each `engines.Leased` engine, renewed from its grant (ExecutionError: refused)."""
        for engine in engines:
            if isinstance(engine, Leased):
                engine.acquire_lease(self.holder, self.ttl, timeout=timeout)
                self.add(engine)

    def release(self, timeout: float) -> None:
        """Stop renewing and release the lease on every engine granted (one that does not answer lets it lapse)."""
        self.stop()
        for engine in self.granted:
            try:
                engine.release_lease(timeout=timeout)
            except Exception:  # noqa: BLE001 - the engine ends a lease that is not released when it lapses
                pass

    def add(self, engine: Any) -> None:
        """Renew `engine` from now on (its first grant was taken by the caller)."""
        self.granted.append(engine)
        endpoint = getattr(engine, "lease_endpoint", None)
        server = endpoint() if callable(endpoint) else None
        if isinstance(server, dict) and isinstance(server.get("url"), str) and self._keeper_add(server):
            return
        self.engines.append(engine)

    def _keeper_add(self, server: dict[str, Any]) -> bool:
        try:
            if self.keeper is None:
                script = Path(__file__)
                self.keeper = subprocess.Popen([sys.executable, "-I", str(script)], stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE, text=True, bufsize=1)
                self._send({"pid": os.getpid(), "holder": self.holder, "ttl": self.ttl, "every": self.ttl / 4})
                threading.Thread(target=self._read, args=(self.keeper,), daemon=True, name="reshard-lease").start()
            self._send({"add": server})
            return True
        except OSError:  # no process to be had: the thread renews it (starved while the GIL is held)
            return False

    def _send(self, value: dict[str, Any]) -> None:
        self.keeper.stdin.write(json.dumps(value) + "\n")
        self.keeper.stdin.flush()

    def _read(self, keeper: Any) -> None:
        for line in keeper.stdout:
            try:
                report = json.loads(line)
                errors, started = report["errors"], float(report.get("started", 0.0))  # (0: renewed nothing)
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            self._report("keeper", errors, started)  # (time.monotonic is one clock for every process)
        if not self.stopped.is_set():
            self._report("keeper", [f"the lease keeper process (PID {keeper.pid}) ended"], 0.0)

    def _report(self, source: str, errors: list[str], started: float) -> None:
        # the last round's: a renewal that failed once and then got through is no error
        self.failures[source] = str(errors[0]) if errors else None
        if not errors:
            self.renewed[source] = max(self.renewed[source], started)

    @property
    def error(self) -> str | None:
        """Why the lease may have lapsed: a renewer's last round failed and its last grant is a ttl old; else None.

        A round that failed inside the lease (a server slow to answer under load) is no error yet: the engine still
        holds the lease, and one that lapses fences the driver, whose later calls it then refuses."""
        for source, failure in self.failures.items():
            age = time.monotonic() - self.renewed[source]
            if failure is not None and age >= self.ttl:
                return (f"the driver's lease could not be renewed for {age:.0f} s (a lease of {self.ttl:g} s: it "
                        f"may have lapsed): {failure}")
        return None

    def _run(self) -> None:
        while not self.stopped.wait(self.ttl / 4):
            # every engine renewed at once: one engine slow to answer must not make the others' leases lapse
            started = time.monotonic()
            calls = [EngineCall(e, "acquire_lease", (self.holder, self.ttl, self.ttl / 2)) for e in list(self.engines)]
            self._report("thread", wait_calls(calls, self.ttl / 2), started)

    def stop(self) -> None:
        """Stop renewing (the leases then lapse after their ttl) and end the keeper process."""
        self.stopped.set()
        if self.keeper is not None:
            try:
                self.keeper.stdin.close()  # the keeper ends at its next round
            except OSError:
                pass
            try:
                self.keeper.wait(self.ttl / 4 + 5.0)
            except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: ended by its PID (we started it)
                self.keeper.kill()
                self.keeper.wait(5.0)
            self.keeper = None
        self.thread.join(self.ttl)


__all__ = ["LeaseRenewal"]

if __name__ == "__main__":
    sys.exit(main())
