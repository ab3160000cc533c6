"""Against real vLLM 0.33 model code on CPU (gloo), for Qwen3 (untied, tied, one KV head replicated over TP2) and
Qwen3-MoE (TP split, and expert parallel at TP2), at vLLM TP1 and TP2; every check compares with vLLM's own `load_weights` of the same
HF checkpoint (saved by transformers), byte for byte per parameter:
  - direct install: a plan from a Megatron layout written straight into the parameters; and the same through
    the `reshard` weight-transfer engine and trainer engine, picked by name from vLLM's factories (the trainer
    drives the worker engine through vLLM's client protocol, served in-process); and colocated, every process
    one trainer rank holding only its own Megatron shard and one vLLM rank, the bytes moved between processes
    by reshard's torch.distributed executor over vLLM's gloo world (`transport="colocated"`);
  - loader install: the same plan's canonical tensors handed to load_weights one module group at a time;
  - the layout derived from the model's loaders (marked tensors) equals the declared VllmLayout, and the probe
    puts the live weights back untouched;
  - a trainer whose destination layout differs from the engine's is refused at init;
  - declarations that differ from vLLM (other shapes; the same shapes with [up; gate] stacking) and models
    that vLLM's CPU post-processing re-laid out (linears dispatched to CPU GEMM kernels; experts padded by the
    CPU MoE backend) are refused before anything moves.
Each TP world runs in its own processes (rank_checks.py, in the session's world of that TP size: conftest.py's
vllm_worlds), TP1 and TP2 concurrently.
"""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm

CASES = {  # name -> (checkpoint, expert parallel, Megatron source layout, colocated source: one rank per process)
    "qwen3": ("qwen3", False, "megatron:tp=2,pp=2", "megatron:tp={w}"),
    "qwen3_tied": ("qwen3_tied", False, "megatron:tp=1,pp=2", "megatron:tp=1,pp={w}"),
    "qwen3_mqa": ("qwen3_mqa", False, "megatron:tp=1,pp=2", "megatron:tp=1,pp={w}"),  # 1 KV head, replicated at TP2
    "qwen3_moe": ("qwen3_moe", False, "megatron:tp=2,ep=2,etp=1,pp=2", "megatron:tp={w},ep={w},etp=1"),
    "qwen3_moe_ep": ("qwen3_moe", True, "megatron:tp=2,ep=2,etp=2", "megatron:tp=1,pp={w}"),
}
WORLDS = {1: ["qwen3", "qwen3_tied", "qwen3_moe"],
          2: ["qwen3", "qwen3_tied", "qwen3_mqa", "qwen3_moe", "qwen3_moe_ep"]}
CHECKS = ["direct_install_matches_load_weights", "loader_install_matches_load_weights",
          "engine_direct_refit_matches_load_weights", "engine_staged_refit_flips_only_at_install",
          "engine_colocated_refit_matches_load_weights",
          "engine_refuses_other_destination", "derived_equals_declared",
          "wrong_shape_declaration_refused", "wrong_stacking_refused"]


def world_jobs(selected, checkpoints, out):
    """This module's cases for the session's worlds (conftest.vllm_worlds), per world the selected ones."""
    return {world: [{"name": n, "ckpt": str(checkpoints[CASES[n][0]]), "ep": CASES[n][1], "src": CASES[n][2],
                     "colocated_src": CASES[n][3]} for n in names if n in selected[world]]
            for world, names in WORLDS.items() if world in selected}


def _params():
    for world, names in WORLDS.items():
        for name in names:
            for check in CHECKS + (["processed_moe_refused"] if "moe" in name else ["processed_model_refused"]):
                yield pytest.param(world, name, check, id=f"tp{world}-{name}-{check}")


@pytest.mark.parametrize("world,case,check", list(_params()))
def test_vllm_destination(reports, world, case, check):
    for rank, report in enumerate(reports[world]):
        assert "setup" not in report[case], f"tp{world} rank {rank} {case}: {report[case].get('setup')}"
        assert report[case][check] == "ok", f"tp{world} rank {rank} {case}: {report[case][check]}"


def test_plugin_entry_point_registers_the_engine_by_name():
    from importlib.metadata import entry_points

    if not [e for e in entry_points(group="vllm.general_plugins") if e.name == "reshard"]:
        pytest.skip("reshard is not installed in this virtualenv (scripts/bootstrap vllm installs it)")
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
    from vllm.plugins import load_plugins_by_group

    load_plugins_by_group("vllm.general_plugins")["reshard"]()  # what every vLLM process runs at start
    assert WeightTransferEngineFactory._registry["reshard"]().__name__ == "ReshardWeightTransferEngine"
    assert WeightTransferTrainerFactory._registry["reshard"]().__name__ == "ReshardTrainerWeightTransferEngine"
