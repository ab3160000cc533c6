"""Waits over a user's gloo group are bounded by reshard's timeout, never by the group's own (gloo's default: 30
minutes): the workers of one vLLM engine agreeing on each refit step (adapters.vllm.session.agreed), and trainer processes
sharing the rendezvous from process 0 (TrainerSession.init). A frozen member makes the others raise
ExecutionError within the timeout."""
from __future__ import annotations

import json

import pytest

from harness.agree_jobs import agree_with_a_frozen_peer, rendezvous_without_process_0
from reshard.testing.megatron_cpu import run_ranks

pytestmark = pytest.mark.fault


TIMEOUT = 3.0


def _with_a_frozen_member(tmp_path, job) -> dict:
    """Two gloo ranks, one frozen for 4 x TIMEOUT; how the other's bounded wait ended, and after how long."""
    out = tmp_path / "outcome.json"
    run_ranks(2, job, {"timeout": TIMEOUT, "frozen_s": 4 * TIMEOUT, "out": str(out)},
              timeout=120, errdir=str(tmp_path), wait_all=True)
    return json.loads(out.read_text())


def test_a_frozen_worker_ends_the_agreement_within_its_timeout(tmp_path):
    result = _with_a_frozen_member(tmp_path, agree_with_a_frozen_peer)
    assert result["outcome"].startswith("ExecutionError") and "did not agree within 3 s" in result["outcome"]
    assert TIMEOUT - 0.5 <= result["seconds"] < TIMEOUT + 5, result


def test_a_frozen_process_0_ends_init_within_the_sessions_timeout(tmp_path):
    result = _with_a_frozen_member(tmp_path, rendezvous_without_process_0)
    assert result["outcome"].startswith("ExecutionError"), result
    assert "rendezvous from process 0 over trainer_group did not arrive within 3 s" in result["outcome"], result
    assert TIMEOUT - 0.5 <= result["seconds"] < TIMEOUT + 5, result
