"""The driver's lease is renewed by a keeper process (adapters.lease_keeper): it keeps renewing while the driver's
GIL is held by a binding (the NIXL/UCX set-up that once let a live driver's lease lapse under load), stops while the
driver is stopped (SIGSTOP: its lease must lapse) and ends when the driver dies. Real processes and a real HTTP
server in a process of its own (a server in this process would be starved by the same held GIL).

Time bounds hold on a loaded machine: what is asserted is what a GIL-bound or stopped renewer would break by a wide
margin (renewals all through a long hold; a quiet spell of twice the lease after SIGSTOP), each wait polled up to a
generous deadline, never a gap near the renewal cadence that the scheduling of the keeper and server can stretch."""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from reshard.adapters.lease_keeper import driver_state
from reshard.adapters.lease_renewal import LeaseRenewal

ROOT = Path(__file__).resolve().parents[2]

# A lease endpoint that prints the wall time of every renewal it hears (one JSON line each).
SERVER = r"""
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        print(json.dumps({"t": time.time(), "holder": body["holder"]}), flush=True)
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *a):
        pass

server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(json.dumps({"port": server.server_address[1]}), flush=True)
server.serve_forever()
"""

# A driver in a process of its own: renews through the keeper, prints the keeper's PID, then idles.
DRIVER = r"""
import json, sys, time
from reshard.adapters.lease_renewal import LeaseRenewal

class Server:
    def lease_endpoint(self):
        return {"url": sys.argv[1], "api_key": None}

renewal = LeaseRenewal([Server()], "driver0a", float(sys.argv[2]))
print(json.dumps({"keeper": renewal.keeper.pid}), flush=True)
time.sleep(600)
"""


class LeaseServer:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{json.loads(self.proc.stdout.readline())['port']}"
        self.heard: list[float] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.heard.append(json.loads(line)["t"])

    def lease_endpoint(self) -> dict:
        return {"url": self.url, "api_key": None}

    def heard_between(self, start: float, end: float) -> list[float]:
        return [t for t in self.heard if start <= t <= end]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def server():
    s = LeaseServer()
    yield s
    s.close()


def _gaps(times: list[float], start: float, end: float) -> float:
    points = [start, *times, end]
    return max(b - a for a, b in zip(points, points[1:]))


def test_renewals_go_on_while_a_binding_holds_the_drivers_gil(server):
    ttl, hold = 4.0, 10  # renewed every ttl / 4 = 1 s; the GIL held for more than twice the lease
    made = time.monotonic()
    renewal = LeaseRenewal([server], "driver0a", ttl)
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:  # a thread of this process: what renewed the lease before the keeper
        while not stop.wait(0.1):
            ticks.append(time.time())

    ticker = threading.Thread(target=tick, daemon=True)
    try:
        assert _wait_for(lambda: server.heard, 30.0), "the keeper never renewed"
        ticker.start()
        time.sleep(0.5)
        start = time.time()
        ctypes.PyDLL(None).sleep(hold)  # a C call through PyDLL keeps the GIL, as NIXL's binding does
        end = time.time()
        time.sleep(0.5)
        stop.set()
        ticker.join()
        # the harness really held the GIL: this process's own thread did not run meanwhile
        assert _gaps([t for t in ticks if start <= t <= end], start, end) > hold / 2
        # renewals went on all through the hold: a renewer stopped by the GIL leaves all of it silent (a gap of
        # `hold`); the 1 s cadence may stretch by seconds when a loaded machine is slow to run keeper and server
        heard = server.heard_between(start, end)
        assert len(heard) >= hold // 3 and _gaps(heard, start, end) < hold / 2, (heard, start, end)
        # the last round's outcome counts (a renewal that timed out under load and then got through is no error)
        assert _wait_for(lambda: renewal.error is None, 10.0), renewal.error
        # the keeper's rounds say when they began: the lease counts from the last renewed one
        assert renewal.renewed["keeper"] > made + hold, (renewal.renewed, made)
    finally:
        renewal.stop()
    assert renewal.keeper is None  # stopped, and waited for


def test_the_keeper_stops_for_a_stopped_driver_and_ends_with_a_dead_one(server):
    ttl = 2.0  # renewed every 0.5 s
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, server.url, str(ttl)], stdout=subprocess.PIPE,
                              text=True, env=env)
    try:
        keeper = json.loads(driver.stdout.readline())["keeper"]
        assert _wait_for(lambda: len(server.heard) >= 2, 30.0), server.heard  # renewing every ttl / 4
        os.kill(driver.pid, signal.SIGSTOP)
        assert _wait_for(lambda: driver_state(driver.pid) == "stopped", 5.0)
        # a frozen driver's lease lapses: the renewals stop, leaving a silence of twice the lease (a round that
        # had begun may still land first); a keeper still renewing never falls silent for 8 rounds
        stopped_at = time.time()
        assert _wait_for(lambda: time.time() - max([stopped_at, *server.heard]) > 2 * ttl, 30.0), \
            f"renewals went on for a stopped driver: {server.heard_between(stopped_at, time.time())}"
        os.kill(driver.pid, signal.SIGCONT)
        resumed_at = time.time()
        assert _wait_for(lambda: server.heard_between(resumed_at, time.time()), 30.0), "no renewal after SIGCONT"
        driver.kill()  # SIGKILL: no clean-up of its own; the keeper must end by itself
        driver.wait(10)
        assert _wait_for(lambda: driver_state(keeper) == "gone", 30.0), "the keeper outlived its driver"
    finally:
        if driver.poll() is None:
            os.kill(driver.pid, signal.SIGCONT)
            driver.kill()
            driver.wait(10)


def test_a_keeper_given_a_bad_config_exits_with_an_error():
    script = ROOT / "reshard/adapters/lease_keeper.py"
    done = subprocess.run([sys.executable, "-I", str(script)], input='{"pid": "1", "holder": "x"}\n',
                          capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "bad keeper config" in done.stderr


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


def test_a_silent_keeper_is_named_once_the_lease_may_have_lapsed(server):
    """A keeper that reports nothing (starved; stopped here) is named as the reason once its last renewal is a lease
    old: the driver's refit then says why the engine may refuse it."""
    ttl = 2.0
    renewal = LeaseRenewal([server], "driver0a", ttl)
    try:
        assert _wait_for(lambda: server.heard, 30.0), "the keeper never renewed"
        assert _wait_for(lambda: renewal.error is None, 30.0), renewal.error  # renewed: no error
        os.kill(renewal.keeper.pid, signal.SIGSTOP)
        assert _wait_for(lambda: renewal.error is not None, 30.0), "a silent keeper went unnoticed"
        assert f"PID {renewal.keeper.pid}" in renewal.error and "reported no renewal" in renewal.error, renewal.error
        os.kill(renewal.keeper.pid, signal.SIGCONT)  # heard again: the next renewed round clears it
        assert _wait_for(lambda: renewal.error is None, 30.0), renewal.error
    finally:
        renewal.stop()
