"""The transport registry's entry point refuses a cross-process transport without a rendezvous before any opener
runs, so a registered third-party opener that never asks the endpoint for its store still cannot start unmet."""
from __future__ import annotations

import pytest

import reshard
from reshard.adapters import transports
from reshard.errors import ExecutionError
from reshard.executors import Binding


def test_a_cross_process_transport_without_a_rendezvous_is_refused_before_its_opener_runs():
    spec = reshard.ModelSpec(family="qwen3", hidden_size=8, num_layers=1, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=4, intermediate_size=8, vocab_size=16, qk_norm=True, dtype="float32")
    plan = reshard.compile_plan(reshard.MegatronLayout(model=spec), reshard.VllmLayout(model=spec))
    opened = []
    transports.register_transport("test-unmet", lambda e: opened.append(e), cross_process=True)
    try:
        endpoint = transports.Endpoint(plan, Binding.disjoint(1, 1), 0, {}, {}, {})
        with pytest.raises(ExecutionError, match="transport 'test-unmet' needs a rendezvous"):
            transports.open_transport("test-unmet", endpoint)
        assert opened == []
    finally:
        transports._TRANSPORTS.pop("test-unmet")
