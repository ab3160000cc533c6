"""reshard's Megatron rank numbering equals megatron-core's own RankGenerator (no model needed)."""
from __future__ import annotations

import pytest

import reshard

pytestmark = pytest.mark.megatron

MOE = reshard.ModelSpec(family="qwen3_moe", hidden_size=8, num_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=2, intermediate_size=0, vocab_size=64, qk_norm=True,
                        num_experts=8, moe_intermediate_size=4)


@pytest.mark.parametrize("tp,pp,ep,etp,world,order", [
    (2, 2, 2, 1, 16, "tp-cp-ep-dp-pp"), (2, 2, 4, 1, 16, "tp-cp-ep-dp-pp"), (1, 2, 2, 2, 8, "tp-cp-ep-dp-pp"),
    (2, 1, 4, 2, 8, "tp-cp-ep-dp-pp"), (2, 2, 2, 1, 8, "tp-cp-ep-pp-dp"), (2, 2, 2, 2, 16, "tp-pp-dp-cp-ep"),
])
def test_rank_order_matches_megatron_core(tp, pp, ep, etp, world, order):
    from megatron.core.parallel_state import RankGenerator

    lay = reshard.MegatronLayout(model=MOE, tp=tp, pp=pp, ep=ep, etp=etp, world=world, rank_order=order)
    dense = RankGenerator(tp=tp, ep=1, dp=lay.dp, pp=pp, cp=1, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=lay.edp, pp=pp, cp=1, order=order)
    # Each generator lists rank groups per axis; a rank's coordinate on an axis is its index inside its group.
    for axis in ("tp", "dp", "pp"):
        for group in dense.get_ranks(axis):
            for i, rank in enumerate(group):
                assert lay.dense_coords(rank)[axis] == i, (axis, group)
    for axis in ("tp", "ep", "dp", "pp"):
        for group in expert.get_ranks(axis):
            for i, rank in enumerate(group):
                assert lay.expert_coords(rank)[axis] == i, (axis, group)
