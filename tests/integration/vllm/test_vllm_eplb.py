"""Refits into an EPLB engine (Qwen3-MoE, 8 experts + 4 redundant, EP2) against vLLM 0.33's own code on CPU: the
placements come from vLLM's EPLB policy on random expert loads and the weights are moved between the EP ranks by
vLLM's rearrangement (eplb_checks.py says how); after one and after two rebalances, a refit through the `reshard`
weight-transfer engine lands byte-identical to an engine that loaded the same checkpoint with vLLM's
`load_weights` and went through the same rebalances (the trainer following the placement the worker extension
reports: `reshard_expert_placement`, then `RefitSpec.with_expert_placement`). The failure users hit -- a refit planned by the initial
placement after a rebalance -- is refused at init naming both placements, as is a refit whose engine rebalanced
after its init (at the refit's start, before any byte lands) and a loader install (vLLM's `load_weights` writes the
initial placement); the stale plan, run anyway into scratch tensors, would have written other bytes.
One process per EP rank (eplb_checks.py)."""
from __future__ import annotations

import json
import sys

import pytest

from vllm_harness import HERE, launch, make_checkpoint, wait

pytestmark = pytest.mark.vllm

CHECKS = ["rebalance_moves_experts_between_ranks", "live_placement_is_eplbs", "stale_plan_refused_at_init",
          "stale_plan_would_corrupt", "trainer_follows_a_stale_plan_at_init", "loader_install_refused",
          "refit_matches_vllm_after_one_rebalance", "refit_after_a_rebalance_since_init_refused",
          "refit_follows_a_rebalance_by_itself", "refit_matches_vllm_after_two_rebalances",
          "fan_out_feeds_redundant_slots_from_the_engine", "direct_binding_checks_loaders_by_the_initial_placement"]
WORLD = 2


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    pytest.importorskip("vllm")
    base = tmp_path_factory.mktemp("eplb")
    ckpts = [make_checkpoint(base / name, "qwen3_moe", seed=seed, experts=8)
             for name, seed in (("old", 11), ("new", 12), ("newer", 13))]
    out = base / "out"
    out.mkdir()
    wait(launch(sys.executable, HERE / "eplb_checks.py", [str(out), *map(str, ckpts)], WORLD, base), timeout=1200)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("check", CHECKS)
def test_eplb_refit(reports, check):
    for rank, report in enumerate(reports):
        assert report["checks"][check] == "ok", f"EP rank {rank}: {report['checks'][check]}"


def test_the_placements_differ(reports):
    """Three placements (initial and two rebalances), the same on both ranks."""
    placements = [r["placements"] for r in reports]
    assert placements[0] == placements[1] and len({placements[0][k] for k in ("p0", "p1", "p2")}) == 3
