"""Expert LoRA adapters of MoE models (per expert, or one shared by all experts) over random TP / EP / expert-TP
layouts and ranks: the cuts place every expert adapter tensor where Megatron-Bridge (SequentialMLP's per-expert
ParallelLinearAdapter, TEGroupedMLP's GroupedExpertLinearAdapter, or its one shared ParallelLinearAdapter), vLLM's
FusedMoEWithLoRA and a PEFT file put it -- each reference written out below by
hand from those projects' slicing rules, not from reshard's cuts -- and plans between them land every byte exactly
once. Dense tensors of the same adapters (attention, dense MLP layers) are checked by test_lora_cuts' references."""
from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, strategies as st

import reshard
from reshard.adapters.lora.slots import AdapterSlot
from reshard.errors import InputError, LayoutError
from reshard.executors import shard
from reshard.layouts.lora import PeftLayout, VllmLoraLayout, lora_facts, lora_spec
from reshard.testing.strategies import megatron_layouts, models, vllm_tp_choices
from harness.layouts import expert_rank
from test_lora_cuts import (SENTINEL, _pad, _weights, bridge_reference, check_round_trip_and_coverage,
                            peft_reference, vllm_reference)

FIELDS = ("tp", "pp", "ep", "etp", "world", "vpp", "first_stage_layers", "last_stage_layers", "naming", "rank_order")


@st.composite
def expert_refits(draw):
    """(Megatron-Bridge source, vLLM LoRA slot destination) of a random adapter adapting a MoE model's experts."""
    base = draw(models(moe=True))
    m = draw(megatron_layouts(base))
    targets = [t for t in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2") if draw(st.booleans())]
    targets = [t for t in targets if t != "linear_proj" or base.hidden_size % m.tp == 0]
    if base.hidden_size % m.etp or (base.dense_layers and base.hidden_size % m.tp):
        targets = [t for t in targets if t != "linear_fc2"]  # linear_fc2's B is cut on its hidden rows
    targets = [t for t in targets if t in ("linear_fc1", "linear_fc2")] and targets or ["linear_fc1"]
    lcm = m.tp * m.etp // __import__("math").gcd(m.tp, m.etp)
    rank = lcm * draw(st.integers(1, 2))  # Megatron-Bridge cuts A's rank dim over TP and over expert TP
    shared = draw(st.booleans())
    spec = lora_spec(base, rank, draw(st.sampled_from([1, 8, 16.0])), targets, "shared" if shared else "per_expert")
    fields = {k: getattr(m, k) for k in FIELDS} | ({"naming": "te"} if shared else {})  # shared: TEGroupedMLP's
    src = reshard.MegatronLayout(model=spec, **fields)
    ep = draw(st.booleans()) and bool(vllm_tp_choices(base, True))
    tp = draw(st.sampled_from(vllm_tp_choices(base, ep)))
    sharded = (not ep and draw(st.booleans()) and base.hidden_size % tp == 0 and rank % tp == 0)
    R = rank + draw(st.integers(0, 5))
    if sharded:
        R = -(-R // tp) * tp
    dst = VllmLoraLayout(model=spec, tp=tp, replicas=draw(st.integers(1, 2)), max_lora_rank=R,
                         fully_sharded=sharded, expert_parallel=ep)
    return src, dst


def _e(w: dict, i: int, e: int, module: str, ab: str) -> torch.Tensor | None:
    """Expert e's A or B: its own, or the layer's one adapter shared by all experts."""
    own = w.get(f"model.layers.{i}.mlp.experts.{e}.{module}.lora_{ab}.weight")
    return own if own is not None else w.get(f"model.layers.{i}.mlp.experts.{module}.lora_{ab}.weight")


def bridge_expert_reference(src: reshard.MegatronLayout, w: dict) -> dict[int, dict[str, torch.Tensor]]:
    """Megatron-Bridge's per-expert adapters: expert e lives on EP rank e // (E/ep) as local expert e % (E/ep),
    cut over expert TP (etp) like a dense MLP's adapter: fc1 A rows, fc1 B per shard [gate_t; up_t], fc2 A columns,
    fc2 B rows. SequentialMLP (naming local): `local_experts.{j}.linear_fc*.adapter.linear_*.weight` each;
    TEGroupedMLP (naming te): one `experts.linear_fc*.adapter.linear_*.weight` stacking the local experts, or, for an
    adapter shared by all experts, that one adapter's shard (the same on every EP rank)."""
    spec, T, shared = src.model, src.etp, lora_facts(src.model).experts == "shared"
    E, local = spec.num_experts, spec.num_experts // src.ep
    out: dict[int, dict[str, torch.Tensor]] = {}
    for i in range(spec.num_layers):
        if not spec.is_moe_layer(i):
            continue
        stage, chunk, pos = src.layer_home(i)
        pre = (f"model{chunk}." if src.vpp > 1 else "") + f"decoder.layers.{pos}.mlp.experts."
        shards: dict[str, list[list[torch.Tensor]]] = {}  # adapter name -> per expert -> per etp rank
        for e in range(E):
            if _e(w, i, e, "gate_up_proj", "A") is not None:
                gate, up = _e(w, i, e, "gate_proj", "B").chunk(T, 0), _e(w, i, e, "up_proj", "B").chunk(T, 0)
                shards.setdefault("linear_fc1.adapter.linear_in.weight", []).append(
                    list(_e(w, i, e, "gate_up_proj", "A").chunk(T, 0)))
                shards.setdefault("linear_fc1.adapter.linear_out.weight", []).append(
                    [torch.cat([a, b]) for a, b in zip(gate, up)])
            if _e(w, i, e, "down_proj", "A") is not None:
                shards.setdefault("linear_fc2.adapter.linear_in.weight", []).append(
                    list(_e(w, i, e, "down_proj", "A").chunk(T, 1)))
                shards.setdefault("linear_fc2.adapter.linear_out.weight", []).append(
                    list(_e(w, i, e, "down_proj", "B").chunk(T, 0)))
        for p in range(src.ep):
            for t in range(T):
                mine = {}
                for name, per_expert in shards.items():
                    experts = [per_expert[e][t] for e in range(p * local, (p + 1) * local)]
                    if shared:
                        mine[pre + name] = per_expert[0][t]
                    elif src.naming == "te":
                        mine[pre + name] = torch.stack(experts)
                    else:
                        mine.update({f"{pre}local_experts.{j}.{name}": x for j, x in enumerate(experts)})
                for d in range(src.edp):
                    out.setdefault(expert_rank(src, t, p, d, stage), {}).update(mine)
    return out


def vllm_expert_reference(dst: VllmLoraLayout, w: dict) -> dict[int, dict[str, torch.Tensor]]:
    """vLLM 0.33's FusedMoEWithLoRA after set_lora, the views [slot] of its buffers: w13 A [E, R, H] per gate / up
    (rows [t R/T, (t+1) R/T) of it when fully sharded), w13 B [E, Fm/T, R] rows chunk t, w2 A [E, R, Fm/T] columns
    chunk t, w2 B [E, H, R] (rows chunk t when fully sharded). With expert parallelism the MoE TP is 1 and rank t
    holds experts [t E/T, (t+1) E/T) whole."""
    spec, T, R, sh = dst.model, dst.tp, dst.max_lora_rank, dst.fully_sharded
    E = spec.num_experts
    out: dict[int, dict[str, torch.Tensor]] = {}
    for t in range(T):
        n, tt, experts = (1, 0, range(t * E // T, (t + 1) * E // T)) if dst.expert_parallel else (T, t, range(E))
        mine: dict[str, torch.Tensor] = {}
        for i in range(spec.num_layers):
            if not spec.is_moe_layer(i):
                continue
            p = f"model.layers.{i}.mlp.experts."
            bufs: dict[str, list[torch.Tensor]] = {}
            for e in experts:
                A = _e(w, i, e, "gate_up_proj", "A")
                if A is not None:
                    a = _pad(A[tt * R // n:(tt + 1) * R // n], (R // n, A.shape[1])) if sh else _pad(A, (R, A.shape[1]))
                    for s, m in enumerate(("gate_proj", "up_proj")):
                        rows = _e(w, i, e, m, "B").chunk(n, 0)[tt]
                        bufs.setdefault(f"{p}w13_lora_a_stacked.{s}", []).append(a)
                        bufs.setdefault(f"{p}w13_lora_b_stacked.{s}", []).append(_pad(rows, (rows.shape[0], R)))
                A = _e(w, i, e, "down_proj", "A")
                if A is not None:
                    a, B = A.chunk(n, 1)[tt], _e(w, i, e, "down_proj", "B")
                    b = B.chunk(n, 0)[tt] if sh else B
                    bufs.setdefault(f"{p}w2_lora_a_stacked.0", []).append(_pad(a, (R, a.shape[1])))
                    bufs.setdefault(f"{p}w2_lora_b_stacked.0", []).append(_pad(b, (b.shape[0], R)))
            mine.update({name: torch.stack(x) for name, x in bufs.items()})
        for k in range(dst.replicas):
            out[t + k * T] = mine
    return out


def peft_expert_reference(spec: reshard.ModelSpec, w: dict) -> dict[str, torch.Tensor]:
    """Megatron-Bridge's export of expert adapters: `experts.{e}.gate_proj` and `.up_proj` each get the fused
    fc1 A; B split into the gate and up halves; down_proj as is; a shared adapter written once per expert."""
    out = {}
    for name, t in w.items():
        if ".mlp.experts." not in name:
            continue
        if not re.search(r"\.experts\.\d+\.", name):  # shared: a copy under each expert's number
            for e in range(spec.num_experts):
                out.update(peft_expert_reference(spec, {name.replace(".experts.", f".experts.{e}."): t}))
        elif ".gate_up_proj.lora_A." in name:
            out.update({"base_model.model." + name.replace("gate_up_proj", m): t for m in ("gate_proj", "up_proj")})
        else:
            out["base_model.model." + name] = t
    return out


def _merged(*refs: dict[int, dict[str, torch.Tensor]]) -> dict[int, dict[str, torch.Tensor]]:
    out: dict[int, dict[str, torch.Tensor]] = {}
    for ref in refs:
        for rank, tensors in ref.items():
            out.setdefault(rank, {}).update(tensors)
    return out


def _expert_free(w: dict) -> dict[str, torch.Tensor]:
    return {n: t for n, t in w.items() if ".mlp.experts." not in n}


@given(expert_refits(), st.integers(0, 2**16))
def test_expert_cuts_match_bridge_vllm_and_peft(pair, seed):
    """Each layout's shards of random adapter weights equal the hand-written references of the projects."""
    src, dst = pair
    w = _weights(src.model, seed)
    assert any(".mlp.experts." in n for n in w)
    got = shard(src, w)
    want = _merged(bridge_reference(src, _expert_free(w)), bridge_expert_reference(src, w))
    assert all(not got[r] for r in set(got) - set(want))
    for rank, tensors in want.items():
        assert sorted(got[rank]) == sorted(tensors), rank
        for name, t in tensors.items():
            assert torch.equal(got[rank][name], t), f"{src} rank {rank} {name}"
    got = shard(dst, w, fill=SENTINEL)
    want = _merged(vllm_reference(dst, _expert_free(w)), vllm_expert_reference(dst, w))
    assert sorted(got) == sorted(want)
    for rank, tensors in want.items():
        assert sorted(got[rank]) == sorted(tensors), rank
        for name, t in tensors.items():
            assert torch.equal(got[rank][name], t), f"{dst} rank {rank} {name}"
    got = shard(PeftLayout(model=src.model), w)[0]
    want = {**peft_reference(src.model, _expert_free(w)), **peft_expert_reference(src.model, w)}
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n], want[n]) for n in want)


@given(expert_refits(), st.integers(0, 2**16), st.booleans())
def test_expert_round_trip_and_coverage(pair, seed, to_peft):
    """Megatron-Bridge's expert shards run through the plan equal the destination's shards byte for byte, padding
    untouched; every destination element holding adapter data is written exactly once."""
    src, dst = pair
    if to_peft:
        dst = PeftLayout(model=src.model, replicas=dst.replicas)
    check_round_trip_and_coverage(src, dst, seed)


def test_unsupported_expert_adapters_are_refused_with_the_rule():
    moe = reshard.ModelSpec(family="qwen3_moe", hidden_size=16, num_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=4, intermediate_size=0, vocab_size=100, qk_norm=True,
                            num_experts=4, moe_intermediate_size=8)
    with pytest.raises(InputError, match="expert_adapters='grouped' is not one of"):
        lora_spec(moe, 8, 16, expert_adapters="grouped")
    with pytest.raises(LayoutError, match="SequentialMLP"):
        reshard.MegatronLayout(model=lora_spec(moe, 8, 16, expert_adapters="shared"), naming="local")
    spec = lora_spec(moe, 6, 12, ["linear_fc1", "linear_fc2"])
    with pytest.raises(LayoutError, match="both expert parallelism and fully_sharded_loras"):
        VllmLoraLayout(model=spec, tp=2, max_lora_rank=8, fully_sharded=True, expert_parallel=True)
    with pytest.raises(LayoutError, match="rank r=6 divisible by tp=4"):
        VllmLoraLayout(model=spec, tp=4, max_lora_rank=8, fully_sharded=True)
    with pytest.raises(LayoutError, match="not divisible by tp=4"):
        reshard.MegatronLayout(model=lora_spec(moe, 2, 4, ["linear_fc1"]), tp=1, etp=4)  # A's rank dim over etp
    with pytest.raises(InputError, match="vLLM slots a refit cannot land in yet"):  # before the engine is read
        AdapterSlot(None, VllmLoraLayout(model=spec, tp=2, max_lora_rank=8), lora_id=1)
