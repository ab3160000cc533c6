"""The driver dies, with Ray engine actors (the NeMo-RL shape): a `VllmEngineActor` (vLLM CPU build, its own
virtualenv, a threaded actor that keeps the driver's lease) is refit by two trainer processes -- Ray drivers of
their own on the same cluster -- whose process 0 is SIGKILLed before, during and after the byte transfer, over
every cross-process transport, one engine for all cases. Each case must leave the engine serving its previous
weights (the same greedy tokens) and version, the dead driver's lease ended by the engine itself within the lease +
the transport's timeout, and a new driver's init + refit must then succeed (tokens of the new weights; reshard's
digest of what landed equal to the checkpoint file's)."""
from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from reshard.adapters.ray import RayEngineClient  # noqa: E402
from harness.driver_faults import check_death_cases, driver_death_cases  # noqa: E402
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
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace=NAMESPACE)
    actor = None
    try:
        actor = start_engine(str(b), 1, name=NAME)
        client = RayEngineClient(actor, NAME, timeout=900.0)  # the first call waits for the engine to start
        engine = {"ray_address": ray.get_runtime_context().gcs_address, "namespace": NAMESPACE, "name": NAME,
                  "tp": 1}
        check_death_cases(engine, client, a, b, cases, work=tmp_path / "cases", lease=LEASE, timeout=TIMEOUT,
                          margin=MARGIN, prompts=PROMPTS, until="ended_at")
    finally:
        if actor is not None:
            stop_engine(actor)
        ray.shutdown()
