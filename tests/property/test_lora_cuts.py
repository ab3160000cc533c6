"""LoRA adapters over random models, ranks and TP layouts: the cuts place every adapter tensor where
Megatron-Bridge's ParallelLinearAdapter, vLLM's LoRA layers and a PEFT file put it (each written out below by hand
from those projects' slicing rules, not from reshard's cuts), and plans between them land every byte exactly."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import reshard
from reshard.errors import InputError, LayoutError
from reshard.executors import allocate, execute_local, shard
from reshard.layouts.lora import PeftLayout, VllmLoraLayout, lora_spec
from reshard.testing.checks import data_mask, write_counts
from reshard.testing.strategies import megatron_layouts, models, vllm_tp_choices
from harness.layouts import dense_rank

SENTINEL = -7.0
ALL = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@st.composite
def lora_refits(draw):
    """(Megatron-Bridge source layout, vLLM LoRA slot layout) of a random adapter of a random model."""
    base = draw(models(moe=draw(st.integers(0, 4)) == 0))
    m = draw(megatron_layouts(base))
    targets = ("linear_qkv", "linear_proj") if base.is_moe else ALL
    if base.hidden_size % m.tp:  # a row-parallel layer's B = ColumnParallelLinear(r, hidden) needs tp | hidden
        targets = tuple(t for t in targets if t in ("linear_qkv", "linear_fc1"))
    targets = tuple(t for t in targets if draw(st.booleans())) or targets[:1]
    rank = m.tp * draw(st.integers(1, 3))  # Megatron-Bridge cuts A's rank dim over TP
    spec = lora_spec(base, rank, draw(st.sampled_from([1, 8, 16.0, 32])), targets)
    fields = ("tp", "pp", "ep", "etp", "world", "vpp", "first_stage_layers", "last_stage_layers", "naming",
              "rank_order")
    src = reshard.MegatronLayout(model=spec, **{k: getattr(m, k) for k in fields})
    tp = draw(st.sampled_from(vllm_tp_choices(base, False)))
    sharded = draw(st.booleans()) and base.hidden_size % tp == 0  # S-LoRA cuts a row-parallel B's rows too
    R = rank + draw(st.integers(0, 5))
    if sharded:
        R = -(-R // tp) * tp
    dst = VllmLoraLayout(model=spec, tp=tp, replicas=draw(st.integers(1, 2)), max_lora_rank=R, fully_sharded=sharded)
    return src, dst


def _weights(spec: reshard.ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=g) for t in spec.tensors}


def _w(w: dict, i: int, module: str, ab: str) -> torch.Tensor | None:
    block = "mlp" if module in ("gate_up_proj", "gate_proj", "up_proj", "down_proj") else "self_attn"
    return w.get(f"model.layers.{i}.{block}.{module}.lora_{ab}.weight")


def _pad(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    out = torch.full(shape, SENTINEL)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def bridge_reference(src: reshard.MegatronLayout, w: dict) -> dict[int, dict[str, torch.Tensor]]:
    """Megatron-Bridge's adapter shards: linear_in of a column-parallel base = ColumnParallelLinear(in, r), rows of
    A chunked over TP; of a row-parallel base = RowParallelLinear(in, r), columns chunked; linear_out =
    ColumnParallelLinear(r, out): rows of the base layer's output order chunked (linear_qkv's interleaved query
    groups [q heads of the group; k; v], linear_fc1's per rank [gate_r; up_r])."""
    spec, T = src.model, src.tp
    g, hpg, d = spec.num_key_value_heads, spec.num_attention_heads // spec.num_key_value_heads, spec.head_dim
    out: dict[int, dict[str, torch.Tensor]] = {}
    for i in range(spec.num_layers):
        stage, chunk, local = src.layer_home(i)
        pre = (f"model{chunk}." if src.vpp > 1 else "") + f"decoder.layers.{local}."
        per: dict[str, list[torch.Tensor]] = {}
        A = _w(w, i, "qkv_proj", "A")
        if A is not None:
            q, k, v = (_w(w, i, m, "B") for m in ("q_proj", "k_proj", "v_proj"))
            rows = []
            for grp in range(g):
                rows += [q[grp * hpg * d:(grp + 1) * hpg * d], k[grp * d:(grp + 1) * d], v[grp * d:(grp + 1) * d]]
            per["self_attention.linear_qkv.adapter.linear_in.weight"] = A.chunk(T, 0)
            per["self_attention.linear_qkv.adapter.linear_out.weight"] = torch.cat(rows).chunk(T, 0)
        if _w(w, i, "o_proj", "A") is not None:
            per["self_attention.linear_proj.adapter.linear_in.weight"] = _w(w, i, "o_proj", "A").chunk(T, 1)
            per["self_attention.linear_proj.adapter.linear_out.weight"] = _w(w, i, "o_proj", "B").chunk(T, 0)
        if _w(w, i, "gate_up_proj", "A") is not None:
            gate, up = _w(w, i, "gate_proj", "B").chunk(T, 0), _w(w, i, "up_proj", "B").chunk(T, 0)
            per["mlp.linear_fc1.adapter.linear_in.weight"] = _w(w, i, "gate_up_proj", "A").chunk(T, 0)
            per["mlp.linear_fc1.adapter.linear_out.weight"] = [torch.cat([a, b]) for a, b in zip(gate, up)]
        if _w(w, i, "down_proj", "A") is not None:
            per["mlp.linear_fc2.adapter.linear_in.weight"] = _w(w, i, "down_proj", "A").chunk(T, 1)
            per["mlp.linear_fc2.adapter.linear_out.weight"] = _w(w, i, "down_proj", "B").chunk(T, 0)
        for t in range(T):
            for dp in range(src.dp):
                rank = out.setdefault(dense_rank(src, t, dp, stage), {})
                rank.update({pre + name: shards[t] for name, shards in per.items()})
    return out


def vllm_reference(dst: VllmLoraLayout, w: dict) -> dict[int, dict[str, torch.Tensor]]:
    """vLLM 0.33's slots after set_lora on TP rank t (vllm/lora/layers: MergedQKVParallelLinearWithLoRA,
    MergedColumnParallelLinearWithLoRA, RowParallelLinearWithLoRA and their *WithShardedLoRA): A of a column-parallel
    layer whole, or rows [t R/T, (t+1) R/T) of it when fully sharded; A of a row-parallel layer columns chunk t;
    q / gate / up B rows chunk t, k / v B rows of KV shard t // (T / kv heads); B of a row-parallel layer whole, or
    rows chunk t when fully sharded. Buffers are [R, in] and [out, R], the rest keeps its value."""
    spec, T, R, sh = dst.model, dst.tp, dst.max_lora_rank, dst.fully_sharded
    g, d = spec.num_key_value_heads, spec.head_dim
    reps, kv = max(1, T // g), max(1, g // T) * d
    out: dict[int, dict[str, torch.Tensor]] = {}
    for t in range(T):
        mine: dict[str, torch.Tensor] = {}

        def col_a(A: torch.Tensor) -> torch.Tensor:
            return _pad(A[t * R // T:(t + 1) * R // T], (R // T, A.shape[1])) if sh else _pad(A, (R, A.shape[1]))

        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            A = _w(w, i, "qkv_proj", "A")
            if A is not None:
                for s, m in enumerate(("q_proj", "k_proj", "v_proj")):
                    B = _w(w, i, m, "B")
                    rows = B.chunk(T, 0)[t] if s == 0 else B[(t // reps) * kv:(t // reps + 1) * kv]
                    mine[f"{p}self_attn.qkv_proj.lora_a_stacked.{s}"] = col_a(A)
                    mine[f"{p}self_attn.qkv_proj.lora_b_stacked.{s}"] = _pad(rows, (rows.shape[0], R))
            A = _w(w, i, "gate_up_proj", "A")
            if A is not None:
                for s, m in enumerate(("gate_proj", "up_proj")):
                    rows = _w(w, i, m, "B").chunk(T, 0)[t]
                    mine[f"{p}mlp.gate_up_proj.lora_a_stacked.{s}"] = col_a(A)
                    mine[f"{p}mlp.gate_up_proj.lora_b_stacked.{s}"] = _pad(rows, (rows.shape[0], R))
            for m, module in (("o_proj", "self_attn.o_proj"), ("down_proj", "mlp.down_proj")):
                A, B = _w(w, i, m, "A"), _w(w, i, m, "B")
                if A is not None:
                    a = A.chunk(T, 1)[t]
                    b = B.chunk(T, 0)[t] if sh else B
                    mine[f"{p}{module}.lora_a_stacked.0"] = _pad(a, (R, a.shape[1]))
                    mine[f"{p}{module}.lora_b_stacked.0"] = _pad(b, (b.shape[0], R))
        for k in range(dst.replicas):
            out[t + k * T] = mine
    return out


def peft_reference(spec: reshard.ModelSpec, w: dict) -> dict[str, torch.Tensor]:
    """Megatron-Bridge's export to PEFT names: a fused layer's A under each of its parts, B split by part."""
    out = {}
    for name, t in w.items():
        for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
            if f".{fused}.lora_A." in name:
                out.update({"base_model.model." + name.replace(fused, p): t for p in parts})
                break
        else:
            out["base_model.model." + name] = t
    return out


@given(lora_refits(), st.integers(0, 2**16))
def test_cuts_match_bridge_vllm_and_peft(pair, seed):
    """Each layout's shards of random adapter weights equal the hand-written reference of the project it models."""
    src, dst = pair
    w = _weights(src.model, seed)
    got = shard(src, w)
    want = bridge_reference(src, w)
    assert got.keys() == want.keys() or all(not got[r] for r in set(got) - set(want))
    for rank, tensors in want.items():
        assert sorted(got[rank]) == sorted(tensors), rank
        for name, t in tensors.items():
            assert torch.equal(got[rank][name], t), f"{src} rank {rank} {name}"
    got = shard(dst, w, fill=SENTINEL)
    for rank, tensors in vllm_reference(dst, w).items():
        assert sorted(got[rank]) == sorted(tensors), rank
        for name, t in tensors.items():
            assert torch.equal(got[rank][name], t), f"{dst} rank {rank} {name}"
    got = shard(PeftLayout(model=src.model), w)[0]
    want = peft_reference(src.model, w)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n], want[n]) for n in want)


@given(lora_refits(), st.integers(0, 2**16), st.booleans())
def test_lora_round_trip_and_coverage(pair, seed, to_peft):
    """Megatron-Bridge shards run through the plan equal the destination's shards byte for byte, padding untouched;
    every destination element holding adapter data is written exactly once."""
    src, dst = pair
    if to_peft:
        dst = PeftLayout(model=src.model, replicas=dst.replicas)
    check_round_trip_and_coverage(src, dst, seed)


def check_round_trip_and_coverage(src, dst, seed: int) -> None:
    """Source shards of random adapter values run through the plan equal the destination's own shards of them
    byte for byte, padding untouched; every destination element holding adapter data is written exactly once."""
    plan = reshard.compile(src, dst)
    w = _weights(src.model, seed)
    got = allocate(dst, fill=SENTINEL)
    execute_local(plan, shard(src, w), got)
    want = shard(dst, w, fill=SENTINEL)
    for rank, tensors in want.items():
        for name, t in tensors.items():
            assert torch.equal(got[rank][name], t), f"{dst} rank {rank} {name}"
    counts = write_counts(plan)
    for key, m in data_mask(dst, None).items():
        assert torch.equal(counts.get(key, torch.zeros_like(m)), m), key
    assert plan.accounting.total_bytes == sum(int(m.sum()) for m in data_mask(dst, None).values()) * 4


def test_bad_adapters_are_refused_with_the_rule():
    base = reshard.ModelSpec(family="qwen3", hidden_size=16, num_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=4, intermediate_size=24, vocab_size=100, qk_norm=True)
    moe = base.model_copy(update={"family": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 8,
                                  "intermediate_size": 0})
    with pytest.raises(InputError, match="rank=0 must be a positive integer"):
        lora_spec(base, 0, 16)
    with pytest.raises(InputError, match="alpha=-1 must be a positive"):
        lora_spec(base, 8, -1)
    with pytest.raises(InputError, match=r"unsupported: \['lm_head'\]"):
        lora_spec(base, 8, 16, ["linear_qkv", "lm_head"])
    with pytest.raises(InputError, match="expert_adapters='grouped' is not one of"):
        lora_spec(moe, 8, 16, expert_adapters="grouped")
    spec = lora_spec(base, 6, 12)
    with pytest.raises(LayoutError, match="not divisible by tp=4"):
        reshard.MegatronLayout(model=spec, tp=4)  # Megatron-Bridge cuts A's rank dim
    with pytest.raises(LayoutError, match="rank r=6 exceeds max_lora_rank=4"):
        VllmLoraLayout(model=spec, tp=2, max_lora_rank=4)
    with pytest.raises(LayoutError, match="max_lora_rank=6 divisible by tp=4"):
        VllmLoraLayout(model=spec, tp=4, max_lora_rank=6, fully_sharded=True)
    with pytest.raises(InputError, match="not a LoRA adapter spec"):
        PeftLayout(model=base)
    with pytest.raises(LayoutError, match="not a LoRA adapter tensor"):
        VllmLoraLayout(model=base, tp=1)
