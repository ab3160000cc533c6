"""reshard.verify against a real `vllm serve` (the vLLM CPU build) and real megatron-core trainer processes (TP=2,
gloo): the trained weights are the served weights, and planted refit bugs are caught.

Per family (Qwen3 dense, Qwen3-MoE), the directory's shared TP-1 server (harness.serve_pool), as fresh on its
checkpoint B (a random checkpoint after one training step):
- `reshard verify` (transformers on B, in this process) finds the fresh server within float32 thresholds;
- megatron-core loaded with B against the fresh server (the baseline), then after a clean refit: within thresholds;
- the slice-sensitivity audit of one tensor of each kind after the clean refit: every perturbation reaches the engine
  and moves its log-probabilities as it moves the trainer's;
- planted bugs, each refit into the same server in turn after a training step (swapped experts, swapped gate/up
  halves, two query heads exchanged, a shard shifted by one column, the last vocabulary rows left stale): the
  mismatch check fails, the audit flags the tensor (and, the engine's model being wrong, also a correct control
  tensor: its responses are taken at wrong weights), and a clean refit afterwards passes again;
- the last vocabulary rows dropped with no training step before (the engine's stale rows equal the trainer's): the
  mismatch check passes, as it must, and the audit names exactly that tensor;
- `reshard verify` against B now fails: the server holds the trainer's later weights (serve_pool refits it back
  to B for the next test that takes it).
"""
from __future__ import annotations

import json
import random

import pytest

from reshard.cli import main as cli
from reshard.testing.megatron_cpu import TinyGPT, run_ranks
from harness.verify_jobs import verify_server

pytestmark = pytest.mark.crossprocess

BUGS = {
    "dense": ["swap gate/up", "swap query heads", "shift shard", "drop last vocab rows"],
    "moe": ["swap experts", "swap gate/up"],
}


def _sequences(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    seqs = [[rng.randrange(vocab) for _ in range(16)] for _ in range(3)]
    return seqs + [[vocab - 1 - i for i in range(8)] + [0, 1, 2, 60, 64, 65, 3, 4]]  # the last ids too


@pytest.mark.parametrize("family", sorted(BUGS))
def test_mismatch_check_and_audit_catch_planted_bugs(family, serve_pool, tmp_path, capsys):
    served = serve_pool.fresh(f"{family}-tp1")
    bugs, b, server = BUGS[family], served.b, served.client
    out = tmp_path / "out.json"
    assert cli(["verify", "--checkpoint", str(b), "--server", server.url, "--sequences", "2",
                "--length", "16"]) == 0, capsys.readouterr().out
    job = {"tiny": served.tiny, "tp": 2, "url": server.url, "checkpoint": str(b),
           "sequences": _sequences(TinyGPT(**served.tiny).vocab_size), "out": str(out), "bugs": bugs,
           "controls": ["decoder.final_layernorm.weight"], "silent": ["drop last vocab rows"]}
    run_ranks(2, verify_server, job, timeout=1200, errdir=str(tmp_path))
    result = json.loads(out.read_text())
    assert "exception" not in result, result["exception"]
    assert cli(["verify", "--checkpoint", str(b), "--server", server.url, "--sequences", "2",
                "--length", "16"]) == 1, "the server holds the trainer's later weights, not B's"
    for bug, found in result.get("bugs", {}).items():  # shown with -s
        print(family, bug, found["tensor"], [(e["tensor"], e["status"], round(e["relative_error"], 3))
                                            for e in found["audit"]["entries"]])
    assert result["fresh"]["ok"], result["fresh"]
    assert result["clean"]["ok"], result["clean"]
    audited = result["audit_clean"]["entries"]
    assert not result["audit_clean"]["failed"], audited
    assert sum(e["status"] == "ok" for e in audited) >= len(audited) - 1, audited  # at most one row no token uses
    kinds = {"embedding", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer", "layernorm"}
    assert all(any(k in e["tensor"] for e in audited) for k in kinds), [e["tensor"] for e in audited]
    assert sorted(result["bugs"]) == sorted(bugs)
    for bug, found in result["bugs"].items():
        assert not found["mismatch"]["ok"], f"{bug}: the mismatch check passed: {found['mismatch']}"
        assert found["tensor"] in found["audit"]["failed"], f"{bug}: the audit did not name {found['tensor']}: " \
            f"{found['audit']}"
        assert found["restored"]["ok"], f"{bug}: the clean refit after it: {found['restored']}"
    # the dropped vocabulary rows again, with no training step before: the engine's stale rows equal the trainer's,
    # so the mismatch check cannot see the bug; the audit can, and names only that tensor
    silent = result["silent"]["drop last vocab rows"]
    assert silent["mismatch"]["ok"], silent["mismatch"]
    assert silent["audit"]["failed"] == ["output_layer.weight"], silent["audit"]
    assert silent["restored"]["ok"]

