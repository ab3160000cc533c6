"""The parts of the vLLM adapter that need no vLLM: decoding loader landings into boxes, padding, the in-process
transport, module groups for loader mode, the refit spec. (Against real vLLM: tests/integration/vllm.)"""
from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import reshard
from reshard.adapters.refit import RefitSpec
from reshard.adapters.vllm import layer_groups
from reshard.executors import ReferenceExecutor
from reshard.adapters.vllm.derive import (UNWRITTEN, _read_placements, declared_placements, marker, placement_problems,
                                         structure_problems, widens)
from reshard.adapters.vllm.direct import padding_runs
from reshard.executors import execute_local, shard
from reshard.layouts.base import Placement

SPEC = reshard.ModelSpec(family="qwen3_moe", hidden_size=8, num_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=2, intermediate_size=12, vocab_size=101, qk_norm=True,
                         num_experts=4, moe_intermediate_size=8, dense_layers=(0,), dtype="float32")


def weights(spec):
    g = torch.Generator().manual_seed(0)
    return {t.name: torch.randn(t.shape, generator=g) for t in spec.tensors}


def landed(layout, rank):
    """What a loader that follows `layout` leaves in float64 scratch: the marker of each placed element."""
    scratch = {n: torch.full(s, UNWRITTEN, dtype=torch.float64) for n, s in layout.rank_tensors(rank).items()}
    marked = {t.name: marker(t) for t in layout.model.tensors}
    return shard_into(layout, rank, scratch, marked)


def shard_into(layout, rank, scratch, canonical):
    from reshard.executors.reference import _box

    for t in layout.model.tensors:
        for p in layout.placements(t):
            if p.rank == rank and 0 not in p.lengths:
                src = canonical[t.name][tuple(slice(o, o + n) for o, n in zip(p.canon_offset, p.lengths))]
                _box(scratch[p.tensor], p.phys_offset, p.lengths).copy_(src)
    return scratch


@pytest.mark.parametrize("tp,ep", [(1, False), (2, False), (4, False), (2, True)])
def test_landings_decode_to_the_declared_placements(tp, ep):
    layout = reshard.VllmLayout(model=SPEC, tp=tp, expert_parallel=ep)
    by_index = {t.index: t for t in SPEC.tensors}
    for rank in range(layout.num_ranks):
        derived, problems = [], []
        for name, values in landed(layout, rank).items():
            d, p = _read_placements(rank, name, values, by_index)
            derived += d
            problems += p
        assert problems == []
        assert sorted(derived) == sorted(declared_placements(layout, rank, SPEC.tensors))


def test_swapped_rows_are_reported_by_name():
    layout = reshard.VllmLayout(model=SPEC, tp=2)
    scratch = landed(layout, 0)
    name = "model.layers.0.mlp.gate_up_proj.weight"
    per = scratch[name].shape[0] // 2
    scratch[name] = torch.cat([scratch[name][per:], scratch[name][:per]])  # [up; gate]
    by_index = {t.index: t for t in SPEC.tensors}
    derived = [p for n, v in scratch.items() for p in _read_placements(0, n, v, by_index)[0]]
    problems = placement_problems(derived, declared_placements(layout, 0, SPEC.tensors))
    assert len(problems) == 2
    assert problems[0].startswith("model.layers.0.mlp.gate_proj.weight: declared [0:6, 0:8] at "
                                  f"{name}[0, 0]; vLLM's loaders put [0:6, 0:8] at {name}[6, 0]")


def test_stray_values_and_broken_boxes_are_problems():
    by_index = {t.index: t for t in SPEC.tensors}
    t = SPEC.tensor("model.norm.weight")
    values = marker(t).clone()
    values[3] = 5.0  # a value that is no canonical element
    _, problems = _read_placements(0, "model.norm.weight", values, by_index)
    assert any("no canonical element" in p for p in problems)
    values = marker(t).clone()
    values[3] = UNWRITTEN  # a hole: the elements are no box
    _, problems = _read_placements(0, "model.norm.weight", values, by_index)
    assert any("do not form boxes" in p for p in problems)
    values = marker(t).clone()[torch.tensor([1, 0, 2, 3, 4, 5, 6, 7])]  # two elements swapped
    derived, problems = _read_placements(0, "model.norm.weight", values, by_index)
    assert not problems and len(derived) == 3  # three boxes, each copied by its own translation...
    whole = [(t.name, Placement(0, "model.norm.weight", (8,), (0,), (8,), (0,)))]
    assert placement_problems(derived, whole)  # ...which are not the declared placement


def test_structure_problems_name_the_tensor_and_both_shapes():
    layout = reshard.VllmLayout(model=SPEC, tp=2)
    live = {n: (s, "float32") for n, s in layout.rank_tensors(0).items()}
    live["model.embed_tokens.weight"] = ((50, 8), "float32")
    live["model.norm.weight"] = ((8,), "bfloat16")  # narrower than the plan: refused
    live["model.layers.0.input_layernorm.weight"] = ((8,), "float64")  # wider: cast at install, not a problem
    del live["lm_head.weight"]
    live["extra.weight"] = ((1,), "float32")
    assert structure_problems(live, layout, 0) == [
        "extra.weight: the live model has (1,) float32, which the declared layout does not hold",
        "lm_head.weight: declared (64, 8) float32, but the live model has no such parameter",
        "model.embed_tokens.weight: live (50, 8) float32, declared (64, 8) float32",
        "model.norm.weight: live (8,) bfloat16, declared (8,) float32",
    ]


def test_only_exact_widening_counts_as_a_cast():
    assert widens("bfloat16", "float32") and widens("float16", "float32") and widens("float32", "float64")
    assert not widens("float32", "bfloat16") and not widens("bfloat16", "float16")  # narrowing / not exact
    assert not widens("bfloat16", "bfloat16") and not widens("bfloat16", "int32")


def test_padding_runs_are_the_vocab_rows_past_v():
    layout = reshard.VllmLayout(model=SPEC, tp=2)  # V=101 -> 128 rows, 64 per rank
    runs = padding_runs(layout, 1)
    H = SPEC.hidden_size
    assert runs == {"model.embed_tokens.weight": [(37 * H, 27 * H)], "lm_head.weight": [(37 * H, 27 * H)]}
    assert padding_runs(layout, 0) == {}


def test_local_executor_fills_only_given_ranks_like_execute_local():
    src = reshard.MegatronLayout(model=SPEC, tp=2, pp=2, ep=2, etp=1)
    dst = reshard.VllmLayout(model=SPEC, tp=2, replicas=2)
    plan = reshard.compile_plan(src, dst)
    w = weights(SPEC)
    src_tensors = shard(src, w)
    want = shard(dst, w)
    everything = shard(dst, {k: torch.zeros_like(v) for k, v in w.items()})
    execute_local(plan, src_tensors, everything)
    got = {3: {n: torch.full_like(t, float("nan")) for n, t in want[3].items()}}
    ReferenceExecutor(plan, None, 0, src_tensors, got).refit()
    for n, t in want[3].items():
        covered = ~torch.isnan(got[3][n])
        assert torch.equal(got[3][n][covered], t[covered]) and torch.equal(everything[3][n], t)


def test_local_executor_refuses_relays_from_other_processes():
    src = reshard.MegatronLayout(model=SPEC, tp=2)
    dst = reshard.VllmLayout(model=SPEC, tp=1, replicas=3)
    plan = reshard.compile_plan(src, dst, fanout=1)
    got = {2: {n: torch.zeros(s) for n, s in dst.rank_tensors(2).items()}}
    with pytest.raises(reshard.ExecutionError, match="relays through destination ranks"):
        ReferenceExecutor(plan, None, 0, shard(src, weights(SPEC)), got)


def test_loader_groups_are_whole_layers_and_cover_every_tensor_once():
    groups = layer_groups(SPEC)
    names = [n for g in groups for n in g]
    assert sorted(names) == sorted(t.name for t in SPEC.tensors) and len(names) == len(set(names))
    assert groups[0] == ("model.embed_tokens.weight",)
    assert groups[-1] == ("model.norm.weight", "lm_head.weight")
    for i, g in enumerate(groups[1:-1]):
        assert {SPEC.tensor(n).layer for n in g} == {i}


def test_loader_install_delivers_full_canonical_tensors_to_every_rank():
    src = reshard.MegatronLayout(model=SPEC, tp=2, pp=2, ep=2, etp=1)
    refit = RefitSpec.of(SPEC, src, reshard.VllmLayout(model=SPEC, tp=2), install="loader")
    plan = refit.plan()
    assert isinstance(plan.dst, reshard.HfLayout) and plan.dst.replicas == 2
    w = weights(SPEC)
    src_tensors = shard(src, w)
    for rank in (0, 1):
        got = {rank: {n: torch.empty(s) for n, s in plan.dst_tensors.on_rank(rank).items()}}
        ReferenceExecutor(plan, None, 0, src_tensors, got).refit()
        assert sorted(got[rank]) == sorted(w) and all(torch.equal(t, w[n]) for n, t in got[rank].items())


def test_refit_spec_round_trips_as_json_and_refuses_bad_fields():
    import json

    src = reshard.MegatronLayout(model=SPEC, tp=2)
    dst = reshard.VllmLayout(model=SPEC, tp=2)
    spec = RefitSpec.of(SPEC, src, dst)
    again = RefitSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec and again.layouts() == (src, dst)
    assert spec.plan().digest == reshard.compile_plan(src, dst).digest
    assert spec.plan() is again.plan()  # compiled once per process
    with pytest.raises(reshard.PlanError, match="install='fast' is not one of"):
        replace(spec, install="fast")
    with pytest.raises(reshard.PlanError, match="unknown fields \\['mode'\\]"):
        RefitSpec.from_dict({**spec.to_dict(), "mode": "direct"})
    with pytest.raises(reshard.PlanError, match="replica=True has type bool"):
        RefitSpec.from_dict({**spec.to_dict(), "replica": True})
    with pytest.raises(reshard.PlanError, match="must be a JSON object"):
        RefitSpec.from_dict([1, 2])
    with pytest.raises(reshard.LayoutError, match="a hf layout is not a refit destination"):
        RefitSpec.of(SPEC, src, reshard.HfLayout(model=SPEC)).layouts()


def test_adapter_refit_specs_name_their_slot_and_nothing_else():
    from reshard.adapters.trainer import TrainerSession
    from reshard.errors import ExecutionError
    from reshard.layouts.lora import VllmLoraLayout, lora_spec

    adapter = lora_spec(SPEC, 8, 16, ["linear_qkv", "linear_proj"])  # SPEC is a MoE: attention adapters
    src, slots = reshard.MegatronLayout(model=adapter, tp=2), VllmLoraLayout(model=adapter, tp=2)
    spec = RefitSpec.of(adapter, src, slots, install="lora_slot", lora_id=3)
    assert RefitSpec.from_dict(spec.to_dict()) == spec and spec.destination() == slots
    assert spec.plan().digest == reshard.compile_plan(src, slots).digest
    for bad in ({"lora_id": None}, {"lora_id": 0}, {"lora_id": True}, {"install": "direct"}):
        with pytest.raises(reshard.PlanError, match="install='lora_slot' needs the served adapter's id"):
            replace(spec, **bad)
    with pytest.raises(reshard.LayoutError, match="a vllm_lora layout accepts install \\['lora_slot'\\]"):
        replace(spec, install="direct", lora_id=None).layouts()
    full = reshard.MegatronLayout(model=SPEC, tp=2)
    with pytest.raises(reshard.LayoutError, match="a vllm layout accepts install \\['direct', 'loader'\\]"):
        RefitSpec.of(SPEC, full, reshard.VllmLayout(model=SPEC, tp=2), install="lora_slot", lora_id=1).layouts()
    with pytest.raises(ExecutionError, match="one id per engine"):
        TrainerSession(RefitSpec.of(SPEC, full, reshard.VllmLayout(model=SPEC, tp=2), transport="inprocess"), 0,
                       {}, lora_ids=[1])


def test_trainer_side_imports_no_vllm():
    code = ("import sys, reshard, reshard.adapters.trainer, reshard.adapters.server, reshard.adapters.refit; "
            "sys.exit(any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_importing_the_adapter_does_not_import_vllm():
    code = ("import sys, reshard, reshard.adapters.vllm; "
            "sys.exit(any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_boxes_that_continue_each_other_are_one_placement():
    """A stack declared as parts (q, k, v channels of a conv1d) that a loader writes as one run is the same
    placement; a part landing elsewhere is still a mismatch."""

    part = lambda c, n, r: ("conv", Placement(0, "w", (128, 1, 4), (c, 0, 0), (n, 1, 4), (r, 0, 0)))  # noqa: E731
    whole = [part(0, 128, 0)]
    assert placement_problems([part(0, 32, 0), part(32, 32, 32), part(64, 64, 64)], whole) == []
    assert placement_problems([part(0, 32, 0), part(32, 32, 64), part(64, 64, 96)], whole)
