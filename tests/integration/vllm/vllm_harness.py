"""Helpers shared by the vLLM tests and the processes they launch: tiny HF checkpoints saved by transformers,
and vLLM models built on CPU without an engine (gloo), as a vLLM worker builds them."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path

import torch

from reshard.ports import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            vocab_size=1000, intermediate_size=128, max_position_embeddings=256, rms_norm_eps=1e-6)
TINY_MOE = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                norm_topk_prob=True, mlp_only_layers=[])


def make_checkpoint(out: str | Path, family: str, tie: bool = False, dtype: str = "bfloat16", seed: int = 0,
                    scale: float = 1.0, kv_heads: int = 2, experts: int | None = None) -> Path:
    """Save a tiny random Qwen3 / Qwen3-MoE with transformers (`experts`: the MoE's, default TINY_MOE's); every
    tensor (norms too) random so that a misplaced row cannot compare equal."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    out = Path(out)
    torch_dtype = getattr(torch, dtype)
    common = dict(TINY, tie_word_embeddings=tie, dtype=dtype, num_key_value_heads=kv_heads)
    moe = dict(TINY_MOE, **({"num_experts": experts} if experts else {}))
    config = Qwen3Config(**common) if family == "qwen3" else Qwen3MoeConfig(**common, **moe)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((torch.randn(p.shape) * scale).to(torch_dtype))
    model.save_pretrained(out)
    return out


def load_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        weights.update(load_file(str(f)))
    return weights


def engine_config(ckpt: str | Path, tp: int, ep: bool = False, dtype: str = "bfloat16"):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(ckpt), tensor_parallel_size=tp, enable_expert_parallel=ep, dtype=dtype,
                      skip_tokenizer_init=True, enforce_eager=True, max_model_len=128, load_format="dummy",
                      distributed_executor_backend="external_launcher" if tp > 1 else None).create_engine_config()


def init_parallel(moe_ckpt: str | Path, world: int, rank: int) -> None:
    """vLLM's process groups over gloo; initialized under a MoE config so the expert-parallel group exists."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(engine_config(moe_ckpt, world)):
        init_distributed_environment(world_size=world, rank=rank, distributed_init_method="env://",
                                     local_rank=rank, backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=world, backend="gloo")


def build_model(vllm_config):
    """The model a vLLM worker builds (parameters in the model dtype, as BaseModelLoader creates them)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_current_vllm_config(vllm_config), set_default_torch_dtype(vllm_config.model_config.dtype):
        return initialize_model(vllm_config)


def cpu_path() -> str:
    """The CPU capability path the test harness pinned for this process (tests/cpu_path/cpu_path_pin.py)."""
    return {"amx": "AMX", "vector": "no AMX"}.get(os.environ.get("RESHARD_TEST_CPU_PATH", ""), "unpinned")


def write_json(path: str | Path, data: object) -> None:
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


class HelperFailed(AssertionError):
    pass


def launch(python: str, script: Path, args: list[str], world: int, log_dir: Path,
           extra_env: dict[str, str] | None = None) -> list[tuple[subprocess.Popen, Path]]:
    """Start `world` processes of a helper script (RANK / WORLD_SIZE / MASTER_* set), logs in log_dir."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   VLLM_TARGET_DEVICE="cpu", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                                       os.environ.get("PYTHONPATH")])),
                   **(extra_env or {}))
        log = log_dir / f"{script.stem}.w{world}.rank{rank}.log"
        f = open(log, "w")
        procs.append((subprocess.Popen([python, str(script), *args], env=env, stdout=f, stderr=subprocess.STDOUT,
                                       cwd=str(ROOT)), log))
        f.close()
    return procs


def wait(procs: list[tuple[subprocess.Popen, Path]], timeout: float) -> None:
    """Wait for every process; on a failure or the timeout kill the rest and fail with the logs' tails."""
    deadline = time.monotonic() + timeout
    try:
        for p, _ in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = [(p, log) for p, log in procs if p.returncode != 0]
    if bad:
        tails = "\n".join(f"--- {log.name} (exit {p.returncode}) ---\n" + "\n".join(log.read_text().splitlines()[-25:])
                          for p, log in bad)
        raise HelperFailed(f"helper processes failed or timed out after {timeout:.0f} s:\n{tails}")


@contextlib.contextmanager
def attributed(case: dict, check: str = ""):
    """Meanwhile, this process's consults of the CPU capability checks (tests/cpu_path) are logged as made by the
    test that asserts the result: the case's `tests` (check, or "" for the case, -> pytest node id; the
    `vllm_worlds` fixture passes them), the case's first where `check` has no test of its own. A world runs many
    tests' cases; scripts/test re-runs on the AMX path the tests whose own work consulted the checks."""
    tests = case.get("tests") or {}
    test = tests.get(check) or next(iter(tests.values()), None)
    saved = os.environ.get("PYTEST_CURRENT_TEST")
    if test is not None:
        os.environ["PYTEST_CURRENT_TEST"] = f"{test} (call)"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PYTEST_CURRENT_TEST", None)
        else:
            os.environ["PYTEST_CURRENT_TEST"] = saved
