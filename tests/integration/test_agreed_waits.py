"""The workers of one vLLM engine agree on each refit step (adapters.vllm.agreed) over a real gloo group: a worker
that never comes to the agreement (frozen) makes the others raise ExecutionError within the agreement's timeout,
never after gloo's 30-minute default."""
from __future__ import annotations

import json

import pytest

from reshard.testing.agree_jobs import agree_with_a_frozen_peer
from reshard.testing.megatron_cpu import run_ranks

pytestmark = pytest.mark.fault


def test_a_frozen_worker_ends_the_agreement_within_its_timeout(tmp_path):
    out = tmp_path / "rank0.json"
    timeout = 3.0
    run_ranks(2, agree_with_a_frozen_peer, {"timeout": timeout, "frozen_s": 4 * timeout, "out": str(out)},
              timeout=120, errdir=str(tmp_path), wait_all=True)
    result = json.loads(out.read_text())
    assert result["outcome"].startswith("ExecutionError") and "did not agree within 3 s" in result["outcome"]
    assert timeout - 0.5 <= result["seconds"] < timeout + 5, result
