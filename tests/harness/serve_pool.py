"""The `vllm serve` processes the modules of tests/integration/serve share (their conftest.py's session fixture
`serve_pool`): a server of the vLLM CPU build costs ~40 CPU-s before its first token (more at TP 2), so one server
per kind is started for the session, on first use, and stopped once the session leaves that directory.

The kinds (SERVERS): a dense or MoE TinyGPT, TP 1 or 2, reshard's worker extension, each started on checkpoint B
of its family: a random checkpoint A (serve_jobs.make_checkpoint) after one training step (serve_jobs.train_step,
elementwise, applied in this process). Its greedy tokens of PROMPTS and vLLM's weight checksums, recorded when it
first answers, are the fresh server's.

The reset point is `pool.fresh(name)`: it hands a test the server as a fresh one on B answers, whatever tests ran
before it (in any order, or none): started again if a test killed it (its tokens and checksums must then be the
recorded ones), its lease ended (a driver's lease lapses or is released: waited for, bounded), and unless its tokens
are the fresh ones and every worker's last refit installed B's bytes whole (or it never had one), refit back to B
by a one-process driver (driver_faults.refit_from_here), after which its tokens and checksums must equal the fresh
server's and every worker must have landed B's bytes. The weight version it reports is whatever the last refit
named: tests read it, never assume it.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

from reshard.executors.checksum import tensor_digests
from reshard.testing.megatron_cpu import TinyGPT

from .serve import ServerProcess
from .serve_jobs import load_checkpoint, make_checkpoint, save_checkpoint, train_step

PROMPTS = [[1, 2, 3, 4, 5], [17, 40, 3, 99], [64, 65, 66, 7, 7, 7, 7, 80]]
FAMILIES = {"dense": {}, "moe": {"num_experts": 4}}  # TinyGPT's fields (its default 4 layers)
SERVERS = {"dense-tp1": ("dense", 1), "dense-tp2": ("dense", 2), "moe-tp1": ("moe", 1), "moe-tp2": ("moe", 2)}
EXTENSION = ("--worker-extension-cls", "reshard.adapters.vllm.worker.ReshardWorkerExtension")
LEASE_WAIT_S = 150.0  # a dead driver's lease (30 s by default) lapses, and the server closes what it left open


class Served:
    """One shared server: `name` (a key of SERVERS), its family and TP, `process` (a ServerProcess) and `client`,
    its family's checkpoints `a` and `b` (it serves B fresh), and the fresh server's `tokens` of PROMPTS (`fresh`)
    and vLLM's weight `checksums`."""

    def __init__(self, name: str, a: Path, b: Path) -> None:
        self.name, self.a, self.b = name, a, b
        self.family, self.tp = SERVERS[name]
        self.process: ServerProcess | None = None
        self.fresh: list | None = None
        self.checksums: dict | None = None
        self.starts = 0

    @property
    def client(self):
        return self.process.client

    @property
    def tiny(self) -> dict:
        return FAMILIES[self.family]


class ServerPool:
    """The shared servers of one session, their checkpoints and logs under `work` (see the module docstring)."""

    def __init__(self, work: Path) -> None:
        self.work = Path(work)
        self._checkpoints: dict[str, tuple[Path, Path]] = {}
        self._served: dict[str, Served] = {}
        self._digests: dict[str, dict] = {}

    def checkpoints(self, family: str) -> tuple[Path, Path]:
        """The family's checkpoints A and B (B = A after one training step), made once."""
        if family not in self._checkpoints:
            a = make_checkpoint(TinyGPT(**FAMILIES[family]), self.work / f"{family}-A")
            b = save_checkpoint({k: train_step(v, 1) for k, v in load_checkpoint(a).items()}, a,
                                self.work / f"{family}-B")
            self._checkpoints[family] = (a, b)
            self._digests[family] = tensor_digests(load_checkpoint(b))  # the file's: ground truth of a reset
        return self._checkpoints[family]

    def start(self, *names: str) -> None:
        """Start those of `names` not running (again, if a test killed one), their start-ups overlapping."""
        todo = []
        for name in names:
            served = self._served.get(name)
            if served is None:
                served = self._served[name] = Served(name, *self.checkpoints(SERVERS[name][0]))
            if served.process is None or not served.process.alive():
                if served.process is not None:
                    served.process.stop()  # what is left of its process group
                served.process = ServerProcess(served.b, tp=served.tp, log=self.work / f"{name}-{served.starts}.log",
                                               extra_args=EXTENSION)
                served.starts += 1
                todo.append(served)
        errors: list[BaseException] = []

        def start(served: Served) -> None:
            try:
                served.process.start()
            except BaseException as e:  # noqa: BLE001 - raised below
                errors.append(e)

        threads = [threading.Thread(target=start, args=(s,)) for s in todo]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        for served in todo:
            tokens, checksums = served.client.greedy(PROMPTS), served.client.weight_checksums()
            if served.fresh is None:
                served.fresh, served.checksums = tokens, checksums
            else:  # started again on B: it must answer as the first start did
                assert tokens == served.fresh and checksums == served.checksums, f"{served.name} started again"

    def fresh(self, name: str) -> Served:
        """The server `name` in its fresh state (the reset point; see the module docstring)."""
        self.start(name)
        served = self._served[name]
        client = served.client
        deadline = time.monotonic() + LEASE_WAIT_S
        while (holder := client.lease_state()["holder"]) is not None:
            assert time.monotonic() < deadline, f"{name}: the lease of {holder!r} did not end"
            time.sleep(0.5)
        if client.greedy(PROMPTS) == served.fresh and self._landed_b(served, missing_ok=True):
            return served
        from .driver_faults import refit_from_here

        refit_from_here({"url": client.url, "tp": served.tp}, served.b, "collective", "reset-to-B")
        assert client.greedy(PROMPTS) == served.fresh, f"{name}: refit back to B, its tokens are not the fresh ones"
        assert client.weight_checksums() == served.checksums, f"{name}: refit back to B, vLLM's checksums differ"
        assert self._landed_b(served, missing_ok=False), f"{name}: refit back to B, a worker landed other bytes"
        return served

    def _landed_b(self, served: Served, missing_ok: bool) -> bool:
        """Whether every worker's last refit installed B's bytes whole (`missing_ok`: or no refit ever ran). Asks
        /reshard_landed only of workers that hold a refit session: where none does, every worker raises, and vLLM's
        executor reads only the first failure of a collective RPC, leaving the others' answers to be read as the
        next RPCs' (a TP-2 server would then answer every later call with the one before's)."""
        sessions = ["flip_s" in s for s in served.client.collective_rpc("reshard_stats")]
        if not any(sessions):
            return missing_ok
        if not all(sessions):
            return False
        landed, want = served.client.landed(), self._digests[served.family]
        return len(landed) == served.tp and all(w["installed"] and w["digests"] == want for w in landed)

    def starts(self) -> int:
        """How many servers the pool started (a killed one started again counts again)."""
        return sum(s.starts for s in self._served.values())

    def close(self) -> None:
        for served in self._served.values():
            if served.process is not None:
                served.process.stop()


__all__ = ["EXTENSION", "FAMILIES", "PROMPTS", "SERVERS", "ServerPool", "Served"]
