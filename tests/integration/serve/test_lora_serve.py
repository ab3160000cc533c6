"""The server shape of a LoRA refit (ART's): a running `vllm serve` with LoRA enabled (the vLLM CPU build, its own
virtualenv) serves an adapter by name from a PEFT directory; the trainer refits it -- publishes the new version
into the same path, atomically, and asks the server to reload it in place -- and the next completions by that name
use the new adapter: the same greedy tokens as the adapter `peft` saved itself from the same values, served under
another name."""
from __future__ import annotations

import pytest

import reshard
from reshard.adapters.lora import PeftDirectory
from reshard.errors import ExecutionError
from reshard.executors import execute_local, shard
from reshard.layouts.lora import PeftLayout, lora_spec
from harness.lora import adapter_weights, save_with_peft
from reshard.testing.megatron_cpu import TinyGPT
from harness.serve import ServerProcess, vllm_cpu_python
from harness.serve_jobs import make_checkpoint

pytestmark = pytest.mark.crossprocess  # trainer side here; the engine runs in the vLLM CPU virtualenv
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[1, 5, 9, 13, 2], [7, 3, 3, 8]]


@pytest.mark.skipif(vllm_cpu_python() is None, reason="no vLLM CPU virtualenv (scripts/bootstrap vllm)")
def test_refit_adapter_in_a_running_server_then_generate_by_name(tmp_path):
    tiny = TinyGPT(num_layers=2)
    checkpoint = make_checkpoint(tiny, tmp_path / "base", seed=0)
    spec = lora_spec(tiny.spec(), 8, 16)
    src_layout = reshard.MegatronLayout(model=spec, tp=2)
    served = PeftDirectory(tmp_path / "adapters" / "policy", PeftLayout(model=spec), base_model=str(checkpoint))
    plan = reshard.compile(src_layout, served.layout)
    weights = [adapter_weights(spec, seed) for seed in (3, 4)]
    theirs = save_with_peft(checkpoint, weights[1], 8, 16, MODULES, tmp_path / "peft")
    execute_local(plan, shard(src_layout, weights[0]), {0: served.tensors})
    served.publish("step-0")
    with ServerProcess(checkpoint, log=tmp_path / "server.log", max_model_len=128,
                       env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
                       extra_args=("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2")) as server:
        server.load_lora_adapter("policy", str(served.path))
        server.load_lora_adapter("reference", str(theirs))
        base = server.greedy(PROMPTS, max_tokens=8)
        reference = server.greedy(PROMPTS, max_tokens=8, model="reference")
        before = server.greedy(PROMPTS, max_tokens=8, model="policy")
        # the refit: the trainer's next adapter into the same path, then reloaded in place by name
        execute_local(plan, shard(src_layout, weights[1]), {0: served.tensors})
        served.publish("step-1")
        server.load_lora_adapter("policy", str(served.path), inplace=True)
        server.call("POST", "/reset_prefix_cache")
        after = server.greedy(PROMPTS, max_tokens=8, model="policy")
        with pytest.raises(ExecutionError, match="HTTP"):
            server.greedy(PROMPTS[:1], max_tokens=2, model="no-such-adapter")
    assert reference != base and before != reference  # the adapters change the tokens: the test can fail
    assert after == reference
