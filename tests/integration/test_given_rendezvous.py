"""Trainer processes given the same `rendezvous=` instead of a `trainer_group` (TrainerSession._meet): process 0
hosts the refit's store at the given address, the others connect there, and each init meets under a refit id of
its own derived from the given one, so a second init's processes never mistake the first's keys for their own.

Two real trainer processes (tp=2) with no trainer group refit a vLLM-free engine (harness.given_rendezvous) over
the collective transport on gloo, init twice; what landed must equal the weights the test made itself, each
init's, also with process 1 beginning each init first (before process 0's store is up; while the last init's still
serves). A process other than 0 given neither is refused, naming both ways to give it the rendezvous; a given
rendezvous without a fixed port is refused, since the others could not find it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import reshard
from reshard.adapters import rendezvous as rv
from reshard.adapters.refit import RefitSpec
from reshard.adapters.trainer import TrainerSession
from reshard.errors import ArgumentError, ExecutionError
from reshard.executors import shard
from reshard.ports import free_port
from reshard.testing.megatron_cpu import run_ranks
from harness.given_rendezvous import refit_at_a_given_rendezvous, weights

# small enough that the processes' set-up, not the bytes, is the test's time
SPEC = reshard.ModelSpec(family="qwen3", hidden_size=32, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, intermediate_size=64, vocab_size=100, qk_norm=True)


@pytest.mark.gloo
def test_trainers_given_one_rendezvous_refit_once_per_init(tmp_path: Path) -> None:
    """Init + refit twice with the same given rendezvous on both processes: each refit lands its generation's
    weights whole, and the two inits meet under different refit ids, both the given one's."""
    given = rv.Rendezvous.new("127.0.0.1", port=free_port(), timeout=30.0)  # a fixed port: the others dial it
    job = {"model": SPEC.model_dump(), "rendezvous": given.to_dict(), "timeout": 60.0, "zero_late_s": 0.5,
           "out": str(tmp_path)}
    run_ranks(2, refit_at_a_given_rendezvous, job, timeout=180, errdir=str(tmp_path))
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    ids = [g["session"] for g in zero]
    assert [g["session"] for g in one] == ids  # both processes met at the same rendezvous, each init
    assert [g["engine"] for g in zero] == ids  # and the engine at the one the payload named
    assert len(set(ids)) == 2 and all(i.startswith(given.refit_id) for i in ids), ids
    for generation in (1, 2):
        assert zero[generation - 1]["version"] == f"step-{generation}"
        landed, expected = load_file(str(tmp_path / f"landed-g{generation}.safetensors")), weights(SPEC, generation)
        assert set(landed) == set(expected)
        for name, w in expected.items():
            assert torch.equal(landed[name], w), (generation, name)


def test_a_process_other_than_0_without_a_rendezvous_is_refused() -> None:
    """Process 1 with neither trainer_group nor rendezvous cannot find process 0's store: init refuses, naming both
    ways to give it the rendezvous."""
    src = reshard.MegatronLayout(model=SPEC, tp=2)
    refit = RefitSpec.of(SPEC, src, reshard.VllmLayout(model=SPEC), install="loader", transport="collective")
    session = TrainerSession(refit, 1, shard(src, weights(SPEC, 1), ranks=[1])[1], timeout=600.0, lease=None)
    with pytest.raises(ExecutionError, match="other than 0 need the rendezvous: pass trainer_group .* or the same "
                                             "`rendezvous` on every process"):
        session.init()
    session.close()


def test_a_given_rendezvous_without_a_port_is_refused() -> None:
    """Port 0 lets process 0's store bind any free port, but without a trainer group nobody tells the others which:
    refused when the session is made, not after the others wait out their timeout."""
    src = reshard.MegatronLayout(model=SPEC, tp=2)
    refit = RefitSpec.of(SPEC, src, reshard.VllmLayout(model=SPEC), install="loader", transport="collective")
    with pytest.raises(ArgumentError, match="needs a fixed port without trainer_group"):
        TrainerSession(refit, 1, shard(src, weights(SPEC, 1), ranks=[1])[1], lease=None,
                       rendezvous=rv.Rendezvous.new("127.0.0.1", port=0))
