"""Hypothesis strategies of random small models and their valid layouts (`random_layouts`' choices, drawn by
hypothesis); `invalid_declarations` lists invalid ones.
"""
from __future__ import annotations

from hypothesis import strategies as st

from ..layouts import HfLayout, Layout, MegatronLayout, ModelSpec, VllmLayout
from ..layouts.expert_placement import ExpertPlacement
from ..planner import Plan, compile_plan
from .random_layouts import Pick, divisors, expert_placement, megatron_layout, vllm_layout, vllm_tp_choices


def _picker(draw) -> Pick:
    """`random_layouts`' pick through hypothesis's draw (so a failing example shrinks)."""
    return lambda options: draw(st.sampled_from(list(options)))


@st.composite
def models(draw, moe: bool | None = None, dtype: str = "float32") -> ModelSpec:
    """A small random model (qwen3, llama or qwen3_moe; `moe` forces the kind): tiny dimensions that still
    exercise GQA/MHA, tied embeddings, odd vocabularies and dense layers between MoE ones."""
    is_moe = draw(st.booleans()) if moe is None else moe
    family = "qwen3_moe" if is_moe else draw(st.sampled_from(["qwen3", "llama"]))
    g = draw(st.sampled_from([1, 2, 4]))
    hpg = draw(st.sampled_from([1, 2, 4]))  # hpg=1 is MHA
    head_dim = draw(st.sampled_from([2, 4, 8]))
    hidden = draw(st.sampled_from([8, 12, 16]))
    layers = draw(st.integers(1, 4))
    experts = draw(st.sampled_from([2, 4, 8])) if is_moe else 0
    dense = tuple(i for i in range(layers) if draw(st.booleans())) if is_moe and layers > 1 else ()
    if len(dense) == layers:
        dense = dense[1:]
    return ModelSpec(
        family=family, hidden_size=hidden, num_layers=layers, num_attention_heads=g * hpg,
        num_key_value_heads=g, head_dim=head_dim,
        intermediate_size=draw(st.sampled_from([8, 12, 16, 24])) if (not is_moe or dense) else 0,
        vocab_size=draw(st.integers(17, 300)), tie_word_embeddings=draw(st.booleans()),
        qk_norm=family != "llama", num_experts=experts,
        moe_intermediate_size=draw(st.sampled_from([4, 8, 12])) if is_moe else 0,
        dense_layers=dense, dtype=dtype)


@st.composite
def megatron_layouts(draw, model: ModelSpec) -> MegatronLayout:
    """A random valid Megatron layout of `model` (random_layouts.megatron_layout's choices, shrinkable)."""
    return megatron_layout(model, _picker(draw))


@st.composite
def expert_placements(draw, model: ModelSpec, ranks: int, redundant: int) -> ExpertPlacement:
    """A random expert placement of `model` over `ranks` EP ranks with `redundant` replica slots."""
    return expert_placement(model, ranks, redundant, _picker(draw))


@st.composite
def vllm_layouts(draw, model: ModelSpec) -> VllmLayout:
    """A random valid vLLM layout of `model` (random_layouts.vllm_layout's choices, shrinkable)."""
    return vllm_layout(model, _picker(draw))


def layouts(model: ModelSpec) -> st.SearchStrategy[Layout]:
    """Any layout of `model`: Megatron, vLLM or HF (one or two replicas)."""
    return st.one_of(megatron_layouts(model), vllm_layouts(model), st.builds(HfLayout, model=st.just(model),
                                                                              replicas=st.integers(1, 2)))


@st.composite
def refits(draw, moe: bool | None = None) -> tuple[Layout, Layout]:
    """A (source, destination) pair of one random model: mostly Megatron -> vLLM, sometimes any -> any."""
    model = draw(models(moe=moe))
    if draw(st.integers(0, 3)) == 0:
        return draw(layouts(model)), draw(layouts(model))
    return draw(megatron_layouts(model)), draw(vllm_layouts(model))


@st.composite
def refit_plans(draw) -> Plan:
    """A compiled plan of a random refit: sometimes with fan-out trees, sometimes colocated."""
    src, dst = draw(refits())
    fanout = draw(st.sampled_from([None, None, 1, 2]))
    colocated = draw(st.booleans()) and dst.num_ranks <= src.num_ranks
    return compile_plan(src, dst, colocated=colocated, fanout=fanout)


# --- invalid declarations, each with the words its error must contain ---------------------------------

def invalid_declarations() -> list[tuple[str, callable, tuple[str, ...]]]:
    """(label, zero-argument constructor, words the error message must contain)."""
    gqa = ModelSpec(family="qwen3", hidden_size=16, num_layers=4, num_attention_heads=8, num_key_value_heads=4,
                    head_dim=4, intermediate_size=24, vocab_size=100, qk_norm=True)
    moe = ModelSpec(family="qwen3_moe", hidden_size=16, num_layers=4, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=4, intermediate_size=0, vocab_size=100, qk_norm=True,
                    num_experts=6, moe_intermediate_size=12)
    M, V = MegatronLayout, VllmLayout
    return [
        ("megatron tp vs heads", lambda: M(model=gqa, tp=3), ("num_attention_heads=8", "tp=3")),
        ("megatron tp vs qkv rows", lambda: M(model=gqa.model_copy(update={
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 1}), tp=4), ("linear_qkv rows", "=6", "tp=4")),
        ("megatron tp vs ffn", lambda: M(model=gqa.model_copy(update={"intermediate_size": 18}), tp=4),
         ("ffn_hidden_size=18", "tp=4")),
        ("megatron world vs tp*pp", lambda: M(model=gqa, tp=2, pp=2, world=6), ("world=6", "tp*pp=4")),
        ("megatron layers vs pp", lambda: M(model=gqa, pp=3), ("num_layers=4", "pp=3")),
        ("megatron uneven stages", lambda: M(model=gqa, pp=3, first_stage_layers=1),
         ("3 layers", "2 other stages")),
        ("megatron first+last != layers at pp=2", lambda: M(model=gqa, pp=2, first_stage_layers=1, last_stage_layers=1),
         ("must equal num_layers=4",)),
        ("megatron vpp with uneven", lambda: M(model=gqa, pp=2, vpp=2, first_stage_layers=1),
         ("cannot be combined with vpp",)),
        ("megatron vpp layers", lambda: M(model=gqa, pp=2, vpp=4), ("num_layers=4", "pp*vpp=8")),
        ("megatron vpp needs pp", lambda: M(model=gqa, pp=1, vpp=2), ("vpp=2 needs pp>=2",)),
        ("megatron experts vs ep", lambda: M(model=moe, ep=4, world=4), ("num_experts=6", "ep=4")),
        ("megatron moe ffn vs etp", lambda: M(model=moe, ep=2, etp=8, world=16), ("moe_ffn_hidden_size=12", "etp=8")),
        ("megatron world vs etp*ep*pp", lambda: M(model=moe, tp=2, ep=3, etp=1, world=4), ("world=4", "etp*ep*pp=3")),
        ("megatron ep on dense", lambda: M(model=gqa, ep=2, world=2), ("ep=2 needs a MoE model",)),
        ("megatron rank order", lambda: M(model=gqa, rank_order="tp-dp-pp"), ("rank_order",)),
        ("megatron zero tp", lambda: M(model=gqa, tp=0), ("tp=0 must be at least 1",)),
        ("vllm heads vs tp", lambda: V(model=gqa, tp=3), ("num_attention_heads=8", "tp=3")),
        ("vllm kv replication", lambda: V(model=moe.model_copy(update={
            "num_attention_heads": 6, "num_key_value_heads": 2}), tp=3), ("tp=3", "num_key_value_heads=2")),
        ("vllm experts vs ep", lambda: V(model=moe, tp=4, expert_parallel=True), ("num_experts=6",)),
        ("vllm moe ffn vs tp", lambda: V(model=moe, tp=8), ("moe_intermediate_size=12", "tp=8")),
        ("vllm ep on dense", lambda: V(model=gqa, tp=2, expert_parallel=True), ("needs a MoE model",)),
        ("vllm replicas", lambda: V(model=gqa, tp=2, replicas=0), ("replicas=0 must be at least 1",)),
        ("vllm vocab padding vs tp", lambda: V(model=gqa, tp=4, vocab_padding=3), ("padded_vocab=102", "tp=4")),
        ("hf replicas", lambda: HfLayout(model=gqa, replicas=0), ("replicas=0",)),
    ]


__all__ = ["divisors", "expert_placements", "invalid_declarations", "layouts", "megatron_layouts", "models", "refits",
           "vllm_layouts", "vllm_tp_choices"]
