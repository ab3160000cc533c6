"""A `vllm serve` (the vLLM CPU build) on host B refit by trainer processes on host A (tests/testbed: two network
namespaces joined by a veth pair). Nothing names an address: the trainer's store and groups bind the address
reshard finds on A, the server's workers theirs on B.

One server for the module (a start costs ~100 s on 2 cores), started on checkpoint B (the weights after one
training step of checkpoint A, computed here, independent of Megatron and of reshard). This process cannot reach
host B: every request to the server comes from a job on host A (serve_job.py) that writes what it saw as JSON.

- refit (collective, nixl): TP 2 trainer processes loaded with A refit the server, take the step and refit again:
  the server's greedy tokens must equal its fresh tokens (started on B), reshard's digests of what landed must equal
  checkpoint B's file's, and the trainer's store must have been hosted at host A's address;
- the issue-43 failure: a trainer whose store binds loopback fails its init within seconds, the error naming
  127.0.0.1 (the server's message, carried back by /init_weight_transfer_engine), and the server answers a
  completion right after, with its previous weights;
- an init whose trainer process never joins does not stop the server generating while its worker waits (the
  engine answers completions and /weight_info in seconds, not after the rendezvous's timeout); the wait's end is
  reported at the trainer's store and by the next start_weight_update; a good refit follows.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from reshard.executors.checksum import tensor_digests
from harness.serve import ServerProcess, vllm_cpu_python
from harness.serve_jobs import load_checkpoint, make_checkpoint, save_checkpoint, train_step
from reshard.testing.megatron_cpu import TinyGPT

pytestmark = pytest.mark.multihost

JOB = str(Path(__file__).with_name("serve_job.py"))
PROMPTS = [[1, 2, 3, 4, 5], [17, 40, 3, 99], [64, 65, 66, 7, 7, 7, 7, 80]]
EXTENSION = ("--worker-extension-cls", "reshard.adapters.vllm.worker.ReshardWorkerExtension")
HEALTH = "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/health', timeout=5)"
RENDEZVOUS_TIMEOUT = 30.0


class Served:
    """The server on host B, its checkpoints, and its fresh answers (asked from host A)."""

    def __init__(self, hosts, process: ServerProcess, a: Path, b: Path, work: Path) -> None:
        self.hosts, self.process, self.a, self.b, self.work = hosts, process, a, b, work
        self.jobs = 0
        first = self.job("fresh")
        assert "error" not in first, first
        self.fresh, self.checksums = first["tokens"], first["checksums"]

    def job(self, action: str, wait: float = 900.0, **extra) -> dict:
        """Run serve_job.py on host A; its JSON answer."""
        self.jobs += 1
        path = self.work / f"job{self.jobs}-{action}.json"
        path.write_text(json.dumps({"action": action, "url": self.process.url, "a": str(self.a), "b": str(self.b),
                                    "server_tp": 1, "prompts": PROMPTS, "timeout": 120.0, **extra}))
        done = self.hosts.a.run([sys.executable, JOB, str(path)], timeout=wait)
        out = path.with_suffix(".out.json")
        assert out.exists(), f"the job wrote nothing; exit {done.returncode}:\n{done.stdout[-3000:]}\n" \
                             f"{done.stderr[-3000:]}\nserver log:\n{self.process.tail()}"
        return json.loads(out.read_text())


@pytest.fixture(scope="module")
def served(two_hosts, tmp_path_factory):
    if vllm_cpu_python() is None:
        pytest.fail("no vLLM CPU virtualenv (scripts/bootstrap vllm makes .venv-vllm-cpu; scripts/test runs it)")
    work = tmp_path_factory.mktemp("serve-multihost")
    a = make_checkpoint(TinyGPT(), work / "A")
    b = save_checkpoint({k: train_step(v, 1) for k, v in load_checkpoint(a).items()}, a, work / "B")
    url: list[str] = []

    def healthy() -> bool:  # asked from host A: this process cannot reach host B
        return two_hosts.a.run([sys.executable, "-c", HEALTH, url[0]], timeout=30).returncode == 0

    process = ServerProcess(b, tp=1, log=work / "server.log", extra_args=EXTENSION, launcher=two_hosts.b.command([]),
                            host=two_hosts.b.address, base_env=two_hosts.b.env(), health=healthy)
    url.append(process.url)
    process.start()
    try:
        yield Served(two_hosts, process, a, b, work)
    finally:
        process.stop()


@pytest.mark.parametrize("transport", ["collective", "nixl"])
def test_trainer_on_one_host_refits_a_server_on_another_at_discovered_addresses(served, two_hosts, transport):
    result = served.job("refit", transport=transport, options={"timeout": 120})
    assert "error" not in result, result.get("trace", result)
    trainer = result["trainer"]
    assert "exception" not in trainer, trainer["exception"]
    assert trainer["rendezvous_host"] == two_hosts.a.address  # found on host A, not configured
    first, last = trainer["refits"][0], trainer["refits"][-1]
    assert "error" not in first and "error" not in last, (first.get("error"), last.get("error"))
    assert first["tokens"] != served.fresh, "refitting checkpoint A's weights did not change the tokens"
    assert last["tokens"] == served.fresh, "after the step's refit the tokens differ from the fresh server's"
    assert last["checksums"] == served.checksums
    want = tensor_digests(load_checkpoint(served.b))  # the checkpoint file, read here
    assert last["landed"] and all(w["installed"] and w["digests"] == want for w in last["landed"])
    assert last["weight_version"] == "step-1"
    print(f"{transport}: init {trainer['init_s']:.1f} s, refits "
          f"{[round(r['seconds'], 2) for r in trainer['refits']]} s")


def test_a_loopback_store_fails_the_trainers_init_at_once_naming_it_and_the_server_keeps_serving(served):
    result = served.job("unreachable")
    assert "error" not in result, result.get("trace", result)
    error = result["init"]
    assert error != "succeeded"
    assert "127.0.0.1" in error and "cannot reach" in error, error  # the server's words, in the trainer's error
    assert result["init_s"] < 15.0, f"the init failed only after {result['init_s']:.0f} s: {error}"
    assert result["greedy_s"] < 15.0, result
    assert result["after"] == result["before"] and result["version_after"] == result["version_before"]


def test_an_init_whose_members_never_join_does_not_stop_the_server_generating(served):
    result = served.job("stuck", rendezvous_timeout=RENDEZVOUS_TIMEOUT)
    assert "error" not in result, result.get("trace", result)
    assert result["store"] == served.hosts.a.address
    # while the worker waited for trainer process 0, the engine generated with its current weights
    assert result["failure_before_greedy_done"] is None, result  # the wait was still on
    assert result["greedy_done_s"] < RENDEZVOUS_TIMEOUT / 2, result
    assert result["greedy_s"] < 10.0 and result["weight_info_s"] < 5.0, result
    assert result["during"] == result["before"] == result["after"]
    assert result["init"].get("outcome") == "returned" and result["init"]["seconds"] < 10.0, result["init"]
    # the wait ended at the rendezvous's timeout: told to the trainer's store, and by the next step
    assert result["failure"] and "did not join" in result["failure"], result["failure"]
    assert result["failure_s"] < RENDEZVOUS_TIMEOUT + 30, result
    assert "did not join" in result["start"] and result["start_s"] < 10.0, result
    # a good init and refit afterwards: checkpoint B's weights, the fresh server's tokens
    recovered = result["recovered"]
    assert recovered["tokens"] == served.fresh and recovered["version"] == "stuck-then-good"
    want = tensor_digests(load_checkpoint(served.b))
    assert all(w["installed"] and w["digests"] == want for w in recovered["landed"])
    assert recovered["rendezvous"] == served.hosts.a.address
