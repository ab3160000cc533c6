"""The distributed executor over NCCL (run on the GPU machine: `-m gpu`; one GPU per process, or two processes on
one GPU joined over loopback sockets, each a host of its own to NCCL: reshard.testing.world): random plans
byte-identical to the local executor, with the default three lanes and with one; and a peer killed or frozen
mid-refit, after which the survivor must raise within the timeout with its destinations unchanged (staged) or
put back (undo). With lanes, that needs every lane aborted at once (runners.abort)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import reshard
from reshard.executors.binding import Binding
from harness.refit_cases import (as_jobs, examples, failures, random_cases, survivor_failures,
                                         tiny_deepseek, tiny_spec)
from reshard.testing.world import run_world

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the GPU machine)")]
WORLD = 2
RANDOM_CASES = 24


def test_refits_on_two_gpus_match_local_executor(tmp_path: Path):
    spec, deepseek = tiny_spec(), tiny_deepseek()
    M, V = reshard.MegatronLayout, reshard.VllmLayout
    e3 = reshard.compile(M(model=spec, tp=2), V(model=spec, replicas=2), colocated=True)
    small = {"bucket_bytes": 512, "timeout": 60.0, "direct_bytes": 128}
    named = [("E3 shape, default lanes, staged", e3, Binding.colocated(2, 2), None, small),
             ("E3 shape, one lane, undo", e3, Binding.colocated(2, 2), None, {**small, "lanes": 1, "undo": True}),
             ("E3 shape, checksums on the GPU (sum64)", e3, Binding.colocated(2, 2), None,
              {**small, "checksum": "sum64", "repeat": 2}),
             ("E3 shape, checksums on the host (sha256)", e3, Binding.colocated(2, 2), None,
              {**small, "checksum": "sha256"}),
             ("E1 shape, in place, repeated", reshard.compile(M(model=spec), V(model=spec)), Binding((0,), (1,)),
              None, {**small, "in_place": True, "repeat": 2}),
             ("DeepSeek, float32 router bias", reshard.compile(M(model=deepseek, tp=2), V(model=deepseek, tp=1,
                                                                                          replicas=2),
                                                               colocated=True), Binding.colocated(2, 2), None, small)]
    cases, labels = as_jobs(named, examples(random_cases(WORLD), RANDOM_CASES), tmp_path)
    results = run_world(WORLD, "harness.refit_jobs:run_cases", {"cases": cases}, tmp_path / "world",
                        timeout=600, backend="nccl")
    logs = (tmp_path / "world" / "logs.txt").read_text()
    assert all(r is not None for r in results), f"a process died:\n{logs[-4000:]}"
    wrong = failures(results, cases, labels, WORLD)
    assert not wrong, "\n".join(wrong[:10])
    assert results[0][0]["stats"]["lanes"] == 3 and results[0][1]["stats"]["lanes"] == 1  # NCCL's default: 3


@pytest.mark.parametrize("mode,undo,lanes", [("kill", False, None), ("hang", False, None), ("kill", True, None),
                                             ("kill", False, 1)])
def test_dead_or_hanging_peer_fails_the_survivor(tmp_path: Path, mode: str, undo: bool, lanes: int | None):
    """E3's shape (each GPU sends to and receives from the other): process 0 dies or freezes at round 3, with
    rounds of earlier lanes still in flight; process 1 must raise within the timeout (plus the abort)."""
    spec = reshard.ModelSpec(family="qwen3", hidden_size=256, num_layers=4, num_attention_heads=8,
                             num_key_value_heads=4, head_dim=32, intermediate_size=768, vocab_size=4096, qk_norm=True)
    plan = reshard.compile(reshard.MegatronLayout(model=spec, tp=2), reshard.VllmLayout(model=spec, replicas=2),
                           colocated=True)
    path = plan.save(tmp_path / "plan.npz")
    timeout = 4.0
    args = {"plan": str(path), "binding": Binding.colocated(2, 2).to_dict(), "seed": 3, "victim": 0, "mode": mode,
            "at_round": 3, "hang_seconds": 4 * timeout,
            "options": {"timeout": timeout, "bucket_bytes": 64 << 10, "lanes": lanes,
                        **({"undo": True} if undo else {})}}
    results = run_world(WORLD, "harness.refit_jobs:fail_mid_refit", args, tmp_path / "world", timeout=60,
                        backend="nccl")
    logs = (tmp_path / "world" / "logs.txt").read_text()
    assert results[0] is None, "the victim should not have finished"
    wrong = survivor_failures(results, [1], undo, timeout + 3.0, logs)
    assert not wrong, "\n".join(wrong)
    assert results[1]["has_dst"] and results[1]["lanes"] == (lanes or 3)
