"""reshard.verify's pure parts: the mismatch statistics against hand-computed values, the thresholds, the audit's
tensor kinds and slices. The checks against real models and a real server are in
tests/integration/serve/test_verify.py."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from reshard.errors import ArgumentError
from reshard.verify import Scores, compare, sample_by_kind, tensor_kind, thresholds
from reshard.verify.audit import slice_rows


def test_statistics_by_hand():
    trainer = Scores.of([[-1.0, -2.0], [-0.5]], [[3, 4], [7]])
    engine = Scores.of([[-1.0, -2.5], [-0.25]], [[3, 5], [7]])
    r = compare(trainer, engine, "bfloat16")
    assert r.tokens == 3
    assert r.max_abs == pytest.approx(0.5) and r.worst == (0, 1)
    assert r.mean_abs == pytest.approx(0.75 / 3)
    # r_i = lp_trainer - lp_engine = 0, 0.5, -0.25; k1 = -r; k3 = e^r - 1 - r
    assert r.mean_k1 == pytest.approx(-(0.5 - 0.25) / 3)
    assert r.mean_k3 == pytest.approx((math.exp(0.5) - 1.5 + math.exp(-0.25) - 0.75) / 3)
    assert r.argmax_agreement == pytest.approx(2 / 3)
    assert not r.ok and any("argmax" in f for f in r.failures)


def test_identical_scores_pass_and_thresholds_depend_on_dtype():
    s = Scores.of([[-1.0, -2.0]], [[1, 2]])
    assert compare(s, s, "float32").ok
    close = Scores.of([[-1.0, -2.01]], [[1, 2]])
    assert not compare(s, close, "float32").ok
    assert compare(s, close, "bfloat16").ok
    assert thresholds("torch.bfloat16") == thresholds("bf16")
    with pytest.raises(ArgumentError, match="dtype"):
        thresholds("int8")


def test_nan_fails_and_shapes_must_match():
    s = Scores.of([[-1.0, -2.0]], [[1, 2]])
    assert not compare(s, Scores.of([[-1.0, float("nan")]], [[1, 2]]), "bfloat16").ok
    with pytest.raises(ArgumentError, match="engine scores"):
        compare(s, Scores.of([[-1.0]], [[1]]))
    with pytest.raises(ArgumentError, match="argmax"):
        Scores.of([[-1.0]], [[1, 2]])


def test_percentiles():
    r = compare(Scores.of([[0.0, 0.0, 0.0]], [[1, 1, 1]]), Scores.of([[-3.0, -1.0, -2.0]], [[1, 1, 1]]), "float32")
    assert r.p50_abs == 2.0
    r = compare(Scores.of([[0.0, 0.0]], [[1, 1]]), Scores.of([[0.0, -10.0]], [[1, 1]]), "float32")
    assert r.p90_abs == pytest.approx(9.0)


def test_kinds_and_slices():
    assert tensor_kind("decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight") == \
        "decoder.layers.*.mlp.experts.local_experts.*.linear_fc1.weight"
    names = ["decoder.layers.1.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc1.weight",
             "decoder.layers.10.mlp.linear_fc1.weight", "output_layer.weight"]
    assert sample_by_kind(names) == ["decoder.layers.0.mlp.linear_fc1.weight", "output_layer.weight"]
    assert slice_rows((64, 3), 8) == [0, 9, 18, 27, 36, 45, 54, 63]  # first and last rows included
    assert slice_rows((3,), 8) == [0, 1, 2]


# --- an in-process engine's prompt log-probabilities, validated position by position (engines.prompt_rows) -------

@dataclass
class _Logprob:  # the fields of vllm.logprobs.Logprob that prompt_rows reads
    logprob: float
    rank: int


def test_prompt_rows_reads_the_token_and_the_rank_1_token():
    from reshard.verify.engines import prompt_rows

    rows = [None, {5: _Logprob(-0.5, 1)}, {7: _Logprob(-2.0, 3), 9: _Logprob(-0.1, 1)}]
    assert prompt_rows([1, 5, 7], rows, "e") == ([-0.5, -2.0], [5, 9])


@pytest.mark.parametrize("rows,why", [
    ([None, {5: _Logprob(-0.5, 1)}], "came back with 2 rows"),
    ([None, {5: _Logprob(-0.5, 1)}, {9: _Logprob(-0.1, 1)}], "position 2 lacks token 7"),
    ([None, {5: _Logprob(-0.5, 1)}, {7: _Logprob(-2.0, 2)}], "position 2 lacks"),
    ([None, {5: _Logprob(float("nan"), 1)}, {7: _Logprob(-2.0, 1)}], "position 1 lacks"),
    (None, "no rows"),
])
def test_prompt_rows_refuses_an_incomplete_answer(rows, why):
    from reshard.errors import ExecutionError
    from reshard.verify.engines import prompt_rows

    with pytest.raises(ExecutionError, match=why):
        prompt_rows([1, 5, 7], rows, "e")
