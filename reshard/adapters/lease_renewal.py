"""The driver's side of the lease (engines.Leased): taken on every engine that keeps one, renewed while the driver
lives, released at the end.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .engines import EngineCall, Leased, wait_calls


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
                script = Path(__file__).with_name("lease_keeper.py")
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
        """Why the lease may have lapsed: a renewer's last grant is a ttl old (its last round failed, or the keeper
        process went silent); else None.

        A round that failed inside the lease (a server slow to answer under load) is no error yet: the engine still
        holds the lease, and one that lapses fences the driver, whose later calls it then refuses."""
        keeper = self.keeper  # (None once stopped, by another thread)
        for source, failure in self.failures.items():
            age = time.monotonic() - self.renewed[source]
            silent = source == "keeper" and keeper is not None  # (the thread reports a round even with no engine)
            if (failure is not None or silent) and age >= self.ttl:
                why = failure or f"the lease keeper process (PID {keeper.pid}) reported no renewal (starved?)"
                return (f"the driver's lease could not be renewed for {age:.0f} s (a lease of {self.ttl:g} s: it "
                        f"may have lapsed): {why}")
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
