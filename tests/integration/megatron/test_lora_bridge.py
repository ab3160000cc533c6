"""Megatron-Bridge's adapter shards, built from megatron-core's own parallel linears as its ParallelLinearAdapter
builds them, on a real GPTModel at TP 2 (gloo): the parameter names, local shapes and megatron-core's own
sharded-state answer (where each shard sits in the global tensor) are what `MegatronLayout` declares for the adapter
spec. (Megatron-Bridge itself does not install here: Python 3.12, transformers <= 5.12.1.)"""
from __future__ import annotations

import json

import pytest

import reshard
from reshard.layouts.lora import lora_spec
from reshard.testing.lora import bridge_shards_job
from reshard.testing.megatron_cpu import TinyGPT, run_ranks

pytestmark = [pytest.mark.megatron, pytest.mark.gloo]
TP, RANK = 2, 8


def test_bridge_adapter_shards_are_the_declared_layout(tmp_path):
    run_ranks(TP, bridge_shards_job, TP, str(tmp_path), RANK, errdir=str(tmp_path), timeout=240)
    spec = lora_spec(TinyGPT(num_layers=2).spec(), RANK, 16)
    layout = reshard.MegatronLayout(model=spec, tp=TP)
    for r in range(TP):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        declared = layout.rank_tensors(r)
        assert sorted(got["parameters"]) == sorted(declared)            # names, as the model has them
        for name, shard in got["shards"].items():
            assert tuple(shard["local"]) == declared[name], name       # local shapes
        # where megatron-core says each shard sits in its global tensor, and where the layout puts canonical data
        for t in spec.tensors:
            for p in layout.placements(t):
                if p.rank != r:
                    continue
                shard = got["shards"][p.tensor]
                cut_dim = [d for d, (g, l) in enumerate(zip(shard["global"], shard["local"])) if g != l]
                assert len(cut_dim) == 1 and shard["offset"][cut_dim[0]] == r * shard["local"][cut_dim[0]], p
                if not any(k in p.tensor for k in ("linear_qkv.adapter.linear_out", "linear_fc1.adapter.linear_out")):
                    # no interleaving: the canonical box is the global one (global = offset + physical position)
                    assert [o + q for o, q in zip(shard["offset"], p.phys_offset)] == list(p.canon_offset), p
