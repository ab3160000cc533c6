"""Two hosts on one machine, for the multihost tests: two Linux network namespaces joined by a veth pair, each with
an address of its own (inside these namespaces only: nothing leaves the machine), made and removed here. Needs
root (CI runs as root) and iproute2.

    with TwoHosts() as hosts:
        hosts.a.address, hosts.b.address           # 10.x.y.1 and 10.x.y.2
        p = hosts.b.popen([python, "-m", ...])      # a process on host B (its loopback is B's own)
        with hosts.ray_cluster() as address:        # a Ray head on A, a worker node on B
            ...

Loopback inside a namespace is its own, so an address that only works on loopback fails across these hosts as it
would across machines; the host name still resolves to 127.0.0.1 inside them, as on many real nodes (gloo's
default device then advertises loopback). Processes started here get no RESHARD_HOST (the single-host tests pin
loopback with it): they must find their addresses themselves. Only processes started here are ended, by PID.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

ROOT = Path(__file__).resolve().parents[2]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def can_make_hosts() -> str | None:
    """Why two hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "making network namespaces needs root (CI runs as root)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (apt-get install iproute2)"
    return None


@dataclass
class Host:
    name: str  # the network namespace
    address: str
    interface: str

    def command(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """This machine's environment less what pins single-host tests to loopback, with this checkout and its test
        harness (tests/) on the path."""
        env = {k: v for k, v in os.environ.items() if k not in ("RESHARD_HOST", "GLOO_SOCKET_IFNAME", "MASTER_ADDR")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH")]))
        env.update(extra or {})
        return env

    def popen(self, argv: Sequence[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """A process on this host (started in a session of its own, so `stop` ends its children too)."""
        return subprocess.Popen(self.command(argv), env=self.env(env), start_new_session=True, **kwargs)

    def run(self, argv: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv), env=self.env(env), capture_output=True, text=True, timeout=timeout)


def stop(process: subprocess.Popen, grace: float = 10.0) -> None:
    """End a process started here and its session (by its PID and process group: nothing else)."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


class TwoHosts:
    """Hosts A and B (see the module docstring); `rate` (e.g. "1gbit") limits the link both ways, through a token
    bucket of `burst` (tc's tbf; at 10gbit a 1mbit bucket refills too seldom to reach the rate)."""

    def __init__(self, rate: str | None = None, burst: str = "1mbit") -> None:
        tag = secrets.token_hex(3)
        subnet = int(tag[:2], 16) % 200 + 20  # 10.<subnet>.<n>.0/24: a private net that exists only in here
        third = int(tag[2:4], 16)
        self.a = Host(f"rs{tag}a", f"10.{subnet}.{third}.1", f"rs{tag}va")
        self.b = Host(f"rs{tag}b", f"10.{subnet}.{third}.2", f"rs{tag}vb")
        self.rate, self.burst = rate, burst
        self._processes: list[subprocess.Popen] = []

    def __enter__(self) -> "TwoHosts":
        why = can_make_hosts()
        if why:
            raise RuntimeError(f"two hosts cannot be made here: {why}")
        try:
            for host in (self.a, self.b):
                _ip("netns", "add", host.name)
                _ip("-n", host.name, "link", "set", "lo", "up")
            _ip("link", "add", self.a.interface, "netns", self.a.name, "type", "veth", "peer", "name",
                self.b.interface, "netns", self.b.name)
            for host in (self.a, self.b):
                _ip("-n", host.name, "addr", "add", f"{host.address}/24", "dev", host.interface)
                _ip("-n", host.name, "link", "set", host.interface, "up")
                if self.rate:
                    subprocess.run(["ip", "netns", "exec", host.name, "tc", "qdisc", "add", "dev", host.interface,
                                    "root", "tbf", "rate", self.rate, "burst", self.burst, "latency", "50ms"],
                                   check=True, capture_output=True, timeout=30)
        except Exception:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for process in reversed(self._processes):
            stop(process)
        for host in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True, timeout=30)

    def start(self, host: Host, argv: Sequence[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """A process on `host` that `__exit__` ends if the test did not."""
        process = host.popen(argv, env, **kwargs)
        self._processes.append(process)
        return process

    @contextlib.contextmanager
    def ray_cluster(self, python: str = sys.executable, cpus_a: int = 4, cpus_b: int = 4, log_dir: Path | None = None,
                    env: dict[str, str] | None = None) -> Iterator[str]:
        """A Ray cluster across the hosts: its head on A, a worker node on B, each node advertising its host's
        address and carrying a custom resource named after it ("host_a": 1000, "host_b": 1000) for placing actors.
        Yields the address a driver on A passes to `ray.init`. The nodes run as `ray start --block` processes
        started here, ended by PID (never `ray stop`, which ends every Ray process of the machine)."""
        ray = str(Path(python).with_name("ray"))
        port = 6379 + secrets.randbelow(2000)
        env = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}
        temp = Path("/tmp") / f"ray-{self.a.name}"  # per node (its sockets); short: socket paths are limited
        logs = [open(log_dir / f"ray-{h}.log", "w") if log_dir else subprocess.DEVNULL for h in ("a", "b")]
        common = ["--block", "--disable-usage-stats", "--min-worker-port=20000", "--max-worker-port=20999"]
        head = self.start(self.a, [ray, "start", "--head", f"--node-ip-address={self.a.address}", f"--port={port}",
                                   f"--num-cpus={cpus_a}", "--resources", '{"host_a": 1000}', f"--temp-dir={temp}",
                                   "--include-dashboard=false",
                                   *common], env, stdout=logs[0], stderr=subprocess.STDOUT)
        address = f"{self.a.address}:{port}"
        _wait_ray(self.a, python, address, 1, head, env)
        worker = self.start(self.b, [ray, "start", f"--address={address}", f"--node-ip-address={self.b.address}",
                                     f"--num-cpus={cpus_b}", "--resources", '{"host_b": 1000}',
                                     f"--temp-dir={temp}b", *common], env, stdout=logs[1], stderr=subprocess.STDOUT)
        _wait_ray(self.a, python, address, 2, worker, env)
        try:
            yield address
        finally:
            for process in (worker, head):
                stop(process, grace=20)
            for log in logs:
                if log is not subprocess.DEVNULL:
                    log.close()


def _wait_ray(host: Host, python: str, address: str, nodes: int, process: subprocess.Popen,
              env: dict[str, str], timeout: float = 240.0) -> None:
    """Until the cluster at `address` has `nodes` live nodes (asked from a driver on `host`). A probe that does not
    answer is asked again: on a loaded 2-core machine one hung past 60 s while the head node was starting (CI's
    timing is not what this waits for)."""
    probe = ("import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
             "print(sum(n['Alive'] for n in ray.nodes()))")
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"a Ray node process exited with {process.returncode} while the cluster formed")
        wait = max(5.0, min(60.0, deadline - time.monotonic()))
        try:
            done = host.run([python, "-c", probe, address], timeout=wait, env=env)
        except subprocess.TimeoutExpired:
            last = [f"a probe had no answer within {wait:.0f} s"]
            continue
        last = (done.stdout + done.stderr).strip().splitlines()[-1:] or [""]
        if done.returncode == 0 and done.stdout.strip().splitlines()[-1:] == [str(nodes)]:
            return
        time.sleep(2)
    raise RuntimeError(f"the Ray cluster at {address} did not reach {nodes} nodes within {timeout:.0f} s: {last}")
