"""Random valid layouts of a model, each choice made by a `pick` function: hypothesis's draw in `strategies`, or a
seeded `random.Random(seed).choice` (the validate round trip). Only values the generic rules allow are offered
(a family's own tensors may still refuse one: LayoutError)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
import math
from typing import Any

from ..layouts import MegatronLayout, ModelSpec, VllmLayout
from ..layouts.expert_placement import ExpertPlacement

Pick = Callable[[Sequence[Any]], Any]
"""Returns one of the options it is given."""

MEGATRON_RANK_ORDERS = ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "tp-pp-dp-cp-ep")


def divisors(n: int) -> list[int]:
    """The positive divisors of `n`, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def megatron_layout(model: ModelSpec, pick: Pick) -> MegatronLayout:
    """A random valid Megatron layout of `model`: TP, PP (even, uneven first / last stages, virtual stages), EP and
    expert TP for MoE, a world of one or two data-parallel copies, vocabulary divisor, naming and rank order."""
    dense_ffn = [model.intermediate_size] if (not model.is_moe or model.dense_layers) else []
    qkv_rows = (model.num_attention_heads + 2 * model.num_key_value_heads) * model.head_dim
    tp = pick(divisors(math.gcd(model.num_attention_heads, qkv_rows, *dense_ffn)))
    L = model.num_layers
    pp_choices = [(p, None, None, 1) for p in divisors(L)]
    pp_choices += [(p, 1, None, 1) for p in (2, 3) if p <= L and (L - 1) % (p - 1) == 0 and L - 1 >= p - 1]
    pp_choices += [(p, None, 1, 1) for p in (2,) if L >= 2]
    pp_choices += [(p, None, None, v) for p in (2,) for v in (2,) if L % (p * v) == 0]
    pp, first, last, vpp = pick(pp_choices)
    ep, etp = 1, tp
    if model.is_moe:
        ep = pick(divisors(model.num_experts))
        etp = pick(divisors(model.moe_intermediate_size)[:3])
    world = math.lcm(tp * pp, etp * ep * pp) * pick([1, 2])
    return MegatronLayout(model=model, tp=tp, pp=pp, ep=ep, etp=etp, world=world, vpp=vpp,
                          first_stage_layers=first, last_stage_layers=last, vocab_divisor=pick([1, 8, 128]),
                          naming=pick(["local", "te"]), rank_order=pick(MEGATRON_RANK_ORDERS))


def vllm_tp_choices(model: ModelSpec, expert_parallel: bool) -> list[int]:
    """The vLLM TP sizes (1, 2, 4, 8) `model`'s heads, FFN and experts allow, with or without expert parallelism."""
    g = model.num_key_value_heads
    experts = model.num_experts if expert_parallel else model.moe_intermediate_size  # what EP or TP cuts
    return [tp for tp in (1, 2, 4, 8) if not model.num_attention_heads % tp and not (g % tp if tp < g else tp % g)
            and not ((not model.is_moe or model.dense_layers) and model.intermediate_size % tp)
            and not (model.is_moe and experts % tp)]


def expert_placement(model: ModelSpec, ranks: int, redundant: int, pick: Pick) -> ExpertPlacement:
    """A placement of `model`'s experts in E + `redundant` slots over `ranks` EP ranks, as EPLB may leave it: every
    expert at least once, the redundant slots any experts, shuffled; one row for every MoE layer, or one each."""
    E = model.num_experts
    moe_layers = sum(model.is_moe_layer(i) for i in range(model.num_layers))

    def row() -> list[int]:
        rest = list(range(E)) + [pick(range(E)) for _ in range(redundant)]
        return [rest.pop(pick(range(len(rest)))) for _ in range(len(rest))]

    rows = [row()] if pick([False, True]) else [row() for _ in range(moe_layers)]
    return ExpertPlacement(ranks=ranks, logical_experts=E, physical_to_logical=rows)


def vllm_layout(model: ModelSpec, pick: Pick) -> VllmLayout:
    """A random valid vLLM layout of `model`: TP, replicas, vocabulary padding; for MoE expert parallelism,
    sometimes with EPLB's redundant experts and a placement of them."""
    ep = model.is_moe and pick([False, True])
    tp = pick(vllm_tp_choices(model, ep) or vllm_tp_choices(model, False))
    if not vllm_tp_choices(model, ep):
        ep = False
    eplb: dict[str, Any] = {}
    if ep and pick([False, True]):  # EPLB: redundant experts (a multiple of the EP size), a placement or vLLM's
        redundant = tp * pick(range(3))
        eplb = {"redundant_experts": redundant}
        if pick([False, True]):
            eplb["expert_placement"] = expert_placement(model, tp, redundant, pick)
    return VllmLayout(model=model, tp=tp, replicas=pick(range(1, 4)), expert_parallel=ep,
                      vocab_padding=pick([tp, 8 * tp, 64]), **eplb)
