"""The NeMo-RL integration into an EPLB engine (Qwen3-MoE, 8 experts + 4 redundant, EP2) against vLLM 0.33's own
code on CPU (integrations_eplb_checks.py says how): the integrations hand vLLM's `load_weights` whole HF tensors and
it writes every expert by vLLM's initial placement (reshard.integrations.groups.refuse_moved_experts has the lines).
Before any rebalance a refit lands byte-identical to vLLM's own loading, redundant slots included; after vLLM's
EPLB moved experts, the next refit is refused at its start on every worker, naming both placements, the policy
worker learns why, and the model keeps its bytes. One process per EP rank."""
from __future__ import annotations

import json
import sys

import pytest

from vllm_harness import HERE, launch, make_checkpoint, wait

pytestmark = pytest.mark.vllm

CHECKS = ["refit_matches_vllm_before_a_rebalance", "refit_after_a_rebalance_refused_before_any_byte_lands"]
WORLD = 2


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    pytest.importorskip("vllm")
    base = tmp_path_factory.mktemp("eplb-integrations")
    ckpts = [make_checkpoint(base / name, "qwen3_moe", seed=seed, experts=8)
             for name, seed in (("old", 21), ("new", 22), ("newer", 23))]
    out = base / "out"
    out.mkdir()
    wait(launch(sys.executable, HERE / "integrations_eplb_checks.py", [str(out), *map(str, ckpts)], WORLD, base),
         timeout=900)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("check", CHECKS)
def test_nemo_rl_refit_into_an_eplb_engine(reports, check):
    for rank, report in enumerate(reports):
        assert report["checks"][check] == "ok", f"EP rank {rank}: {report['checks'][check]}"


def test_the_rebalance_moved_experts(reports):
    placements = [r["placements"] for r in reports]
    assert placements[0]["p0"] == placements[1]["p0"] and placements[0]["p1"] == placements[1]["p1"]
    assert placements[0]["p0"] != placements[0]["p1"]
    print(json.dumps(placements, indent=1))
