"""The plan side of the verl backend (reshard.integrations.verl.topology): pure, no verl, no processes. The
backend itself, driven by verl's own manager and workers, is tested in tests/integration/verl (marker verl)."""
from __future__ import annotations

import pytest

from reshard.errors import ArgumentError, ExecutionError
from reshard.integrations.groups import group_bindings, tensor_groups
from reshard.integrations.verl import topology as tp
from reshard.testing.megatron_cpu import TinyGPT

SPEC = TinyGPT(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, head_dim=16,
               vocab_size=5000, padded_vocab_size=5008, num_experts=4, moe_ffn_hidden_size=32).spec("float32")
MB = 1 << 20
RDV = {"host": "127.0.0.1", "port": 1, "refit_id": "abc", "secret": "0" * 32, "timeout": 5.0}


def metadata(trainers: int, rollouts: int, bucket: int = MB, **options):
    common = {"model_digest": tp.model_digest(SPEC), "bucket_size": bucket, "options": options}
    out = [{"role": "trainer", "master": p == 0, **common} for p in range(trainers)]
    out[0].update(model=SPEC.model_dump(), rendezvous=RDV)
    return out + [{"role": "rollout", "master": False, **common} for _ in range(rollouts)]


def nbytes(name: str) -> int:
    return SPEC.tensor(name).numel * SPEC.itemsize


def test_groups_cover_the_model_in_order_within_the_bucket():
    for bucket in (MB, 64 << 10, 1):
        groups = tensor_groups(SPEC, bucket)
        assert [n for g in groups for n in g] == [t.name for t in SPEC.tensors]
        for g in groups:
            assert len(g) == 1 or sum(nbytes(n) for n in g) <= bucket
    assert max(nbytes(t.name) for t in SPEC.tensors) > MB  # the embedding travels in a group of its own


@pytest.mark.parametrize("trainers,rollouts,fanout", [(2, 3, None), (3, 2, None), (2, 3, 1), (4, 4, 2)])
def test_every_trainer_sends_its_share(trainers, rollouts, fanout):
    actor, rollout = tp.build(trainers, rollouts, metadata(trainers, rollouts, fanout=fanout))
    assert [t["process"] for t in actor + rollout] == list(range(trainers + rollouts))
    top = tp.RefitAssignment.from_dict(actor[0])
    plans = top.plans()
    sent = [0] * trainers
    for plan, binding in zip(plans, group_bindings(plans, trainers, rollouts)):
        for s, b in enumerate(plan.accounting.egress_bytes):
            sent[binding.src[s]] += b
    model = sum(nbytes(t.name) for t in SPEC.tensors)
    assert sum(sent) == (model if fanout else rollouts * model)  # fan-out: the trainers send one copy
    # no rank-0 funnel: every rank within one unit (a destination's copy of one tensor) of an even share
    assert max(sent) <= sum(sent) / trainers + max(nbytes(t.name) for t in SPEC.tensors), sent
    assert min(sent) > 0


def test_bucket_smaller_than_a_message_is_refused_naming_it():
    with pytest.raises(ArgumentError, match="bucket_size=4 is smaller than the wire buffers"):
        tp.build(2, 3, metadata(2, 3, bucket=4))


@pytest.mark.parametrize("change,field", [
    (lambda m: m[3].update(model_digest="0" * 16), "metadata.model_digest"),
    (lambda m: m[4].update(bucket_size=2 * MB), "metadata.bucket_size"),
    (lambda m: m[1].update(options={"fanout": 1}), "metadata.options"),
    (lambda m: m[2].update(role="trainer"), "metadata"),
    (lambda m: m[1].update(master=True), "metadata"),
])
def test_ranks_that_disagree_are_refused(change, field):
    meta = metadata(2, 3)
    change(meta)
    with pytest.raises(ArgumentError) as e:
        tp.build(2, 3, meta)
    assert e.value.field == field


def test_options_and_topologies_are_checked():
    with pytest.raises(ArgumentError, match="transport"):
        tp.check_options({"transport": "carrier-pigeon"})
    with pytest.raises(ArgumentError, match="unknown|not options"):
        tp.check_options({"fanotu": 2})
    actor, _ = tp.build(2, 3, metadata(2, 3))
    with pytest.raises(ArgumentError):
        tp.RefitAssignment.from_dict({**actor[0], "extra": 1})
    forged = tp.RefitAssignment.from_dict({**actor[0], "digests": ["0" * 12] * len(actor[0]["digests"])})
    with pytest.raises(ExecutionError, match="disagree"):
        forged.plans()


def test_module_imports_without_verl():
    import importlib.util

    import reshard.integrations.verl as integration

    if importlib.util.find_spec("verl") is None:
        assert integration.ReshardCheckpointEngine is None
    assert integration.BACKEND == "reshard"
