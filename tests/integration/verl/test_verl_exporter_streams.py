"""The stream verl's FSDP engine gets from transformers 5, through reshard's verl backend, driven by verl's real
CheckpointEngineManager on CPU (harness.verl_cpu, a local Ray cluster): 2 trainer ranks stream a tiny
Qwen3-MoE's `state_dict()` (routed experts fused: `mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
[E, H, I]) into 3 rollout ranks, whose stand-in for vLLM's server adapter holds the checkpoint transformers'
`save_pretrained` wrote (per-expert names), refuses any other name, shape or a missing tensor, records every tensor
it is handed and, as vLLM's adapter does, sets verl's version (`global_steps`) only after a complete update.
Expected bytes: transformers' own reverse conversion (`revert_weight_conversion`) of the trainers' state dict,
replayed here, independent of reshard.

Refused streams, at every position, in both stagings and over two transports: what each rollout rank's server
adapter was handed, what it serves afterwards, and how long the refusal took to reach the caller (verl's
`update_weights`) and every rollout rank, with the backend's default timeouts (300 s)."""
from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from reshard.layouts.families import discover, read_hf_config
from harness import verl_cpu as vc

pytestmark = pytest.mark.verl

TRAINERS, ROLLOUTS = 2, 3
FAIL_FAST_S = 30.0  # the bound asserted (a tenth of the default timeout); the figures measured are printed
FUSED = "model.layers.2.mlp.experts.gate_up_proj"  # a fused tensor in the middle of the stream


def _qwen3_moe(directory):
    """transformers' checkpoint of a tiny Qwen3-MoE (the published config at toy sizes, with a vocabulary and
    experts large enough for 1 MiB buckets to cut it into several groups: the embedding alone exceeds one), float32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = read_hf_config("examples/configs/qwen3-30b-a3b.json")
    tiny = {**discover(config).tiny_config(config), "vocab_size": 5000, "num_experts": 8,
            "moe_intermediate_size": 128, "bos_token_id": None, "eos_token_id": None}
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny)).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def cluster(ray_runtime, tmp_path_factory):
    checkpoint = _qwen3_moe(tmp_path_factory.mktemp("verl") / "checkpoint")
    refit = vc.Refit(TRAINERS, ROLLOUTS, checkpoint, vc.checkpoint_engine_config(checkpoint, 1),
                     tiny=None)  # the trainers stream the transformers model of the checkpoint, as its state dict
    refit.steps = []  # the training steps taken so far, in order (what `expected` replays)
    yield refit
    refit.shutdown()


def train(cluster) -> int:
    step = len(cluster.steps) + 1
    cluster.trainers.train_step(step)
    cluster.steps.append(step)
    return step


def expected(cluster) -> tuple[dict[str, str], list[str]]:
    """What the rollout must serve after the trainers' steps so far (transformers' own per-expert names and
    bytes) and the names the trainers stream (their state dict's)."""
    from transformers.core_model_loading import revert_weight_conversion

    export = vc.HfExport(cluster.checkpoint)
    for step in cluster.steps:
        export.train_step(step)
    state = export.model.state_dict()
    return ({n: vc.digest(t) for n, t in revert_weight_conversion(export.model, dict(state)).items()}, list(state))


def streamed_as(name: str) -> str:
    """The stream item a served tensor comes from (a per-expert tensor from its layer's fused one)."""
    name = re.sub(r"experts\.\d+\.(gate|up)_proj\.weight$", "experts.gate_up_proj", name)
    return re.sub(r"experts\.\d+\.down_proj\.weight$", "experts.down_proj", name)


def check_serves(cluster, step: int) -> None:
    want, _ = expected(cluster)
    for r, (version, digests) in enumerate(cluster.served()):
        assert version == step, f"rollout rank {r} serves step {version}, expected {step}"
        assert set(digests) == set(want), f"rollout rank {r}: names {sorted(set(digests) ^ set(want))[:5]}"
        wrong = sorted(n for n in want if digests[n] != want[n])
        assert not wrong, f"rollout rank {r}: {len(wrong)} tensors differ, e.g. {wrong[:3]}"


def test_a_fused_expert_stream_refits_byte_for_byte(cluster):
    step = train(cluster)
    cluster.refit(step)
    want, streamed = expected(cluster)
    assert FUSED in streamed  # the stream is the fused one
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in want  # what vLLM's loader takes
    check_serves(cluster, step)


def test_a_group_is_received_while_the_adapter_takes_the_one_before(cluster, tmp_path):
    """Pipelined, with bounded memory ("bucket" staging): while every rollout rank's server adapter holds the
    refit's first group, the second moves to every process (received on the transfer thread), the third does not
    (a rollout rank holds two groups); the event loop meanwhile answers calls."""
    import ray

    cluster.reconfigure(vc.checkpoint_engine_config(cluster.checkpoint, 1))
    go = tmp_path / "go"
    cluster.rollouts.hold(str(go))
    step = train(cluster)
    outcome: list = []
    refit = threading.Thread(target=lambda: outcome.append(cluster.refit(step)))
    refit.start()
    try:
        size, moved, deadline = TRAINERS + ROLLOUTS, [], time.monotonic() + 60
        while not (len(moved) > 1 and moved[1][1] == size) and time.monotonic() < deadline:
            moved = ray.get(cluster.rollouts.workers[0].moved.remote(), timeout=30)
            time.sleep(0.05)
        assert len(moved) > 1 and moved[1][1] == size, f"the second group did not move while the first was held: " \
                                                       f"{moved}"
        time.sleep(0.5)  # time enough for a third group, were it allowed
        moved = ray.get(cluster.rollouts.workers[0].moved.remote(), timeout=30)
        assert len(moved) < 3 or moved[2][1] < size, f"a third group moved while two were held: {moved}"
        assert all(not cs[-1]["names"][1:] for cs in cluster.rollouts.calls()), "an adapter went past its hold"
    finally:
        go.touch()
        refit.join(120)
        cluster.rollouts.hold(None)
    assert outcome, "the refit failed"
    check_serves(cluster, step)


# position -> (fault kind, where in the stream: "middle" = the fused tensor FUSED, -1 = after the last item,
# trainer rank (None: every rank, as an exporter's own fault is), what the caller's error names)
FAULTS = {
    "first": ("extra", 0, None, "not_a_tensor"),  # (a) an unknown tensor before the model's own
    "middle": ("shape", "middle", None, FUSED),  # (b) a misshapen (fused) tensor in the middle
    "last": ("extra", -1, None, "not_a_tensor"),  # (c) an unknown tensor after the last one
    "missing": ("skip", "middle", None, "never came"),
    "repeated": ("repeat", "middle", None, "came twice"),
    "middle-rank1": ("shape", "middle", 1, FUSED),  # only one trainer rank's stream is wrong
}
CASES = [(p, s, t) for p in ("first", "middle", "last") for s in ("bucket", "model") for t in ("collective", "shared")]
CASES += [("missing", "bucket", "collective"), ("repeated", "model", "shared"), ("middle-rank1", "bucket", "shared")]


def ended_calls(cluster, step: int, deadline: float) -> list[dict]:
    """Every rollout rank's server-adapter call for `step`, once each has ended (or the deadline passed)."""
    while True:
        calls = [[c for c in cs if c["step"] == step][-1] for cs in cluster.rollouts.calls()]
        if all(c["ended"] is not None for c in calls) or time.monotonic() > deadline:
            return calls
        time.sleep(0.05)


@pytest.mark.parametrize("position,staging,transport", CASES)
def test_a_refused_stream_hands_on_only_what_every_process_agreed_on(cluster, position, staging, transport):
    kind, at, rank, named = FAULTS[position]
    cluster.reconfigure(vc.checkpoint_engine_config(cluster.checkpoint, 1, staging=staging, transport=transport))
    before = cluster.served()
    _, streamed = expected(cluster)
    at = streamed.index(FUSED) if at == "middle" else at
    cluster.trainers.set_fault({"kind": kind, "at": at}, rank)
    step = train(cluster)
    want, _ = expected(cluster)  # the new version
    try:
        with pytest.raises(Exception) as failure:
            cluster.refit(step)
        raised = time.monotonic()
        refused = min(t for t in cluster.trainers.fault_injected() if t is not None)
    finally:
        cluster.trainers.set_fault({}, None)
    assert named in str(failure.value), str(failure.value)[-2000:]
    calls = ended_calls(cluster, step, refused + FAIL_FAST_S)
    ended = [c["ended"] - refused if c["ended"] is not None else None for c in calls]
    print(f"\n{position}/{staging}/{transport}: refusal -> caller's exception {raised - refused:.3f} s, "
          f"-> rollout ranks' update_weights raised {[round(e, 3) if e is not None else e for e in ended]} s")
    assert raised - refused < FAIL_FAST_S
    assert all(e is not None and e < FAIL_FAST_S for e in ended), ended

    last = streamed_as(max(want, key=lambda n: streamed.index(streamed_as(n))))  # lm_head: the stream's last
    for r, (call, (version, digests), (old_version, old)) in enumerate(zip(calls, cluster.served(), before)):
        got = set(call["names"])
        assert not call["ok"] and version == old_version, f"rollout rank {r} took verl's version {version}"
        if staging == "model" or position == "first":
            assert not got, f"rollout rank {r} was handed {sorted(got)[:3]}"
        if position != "missing":  # (with a group missing, the trainers never complete the refit's last group)
            assert not {n for n in got if streamed_as(n) == last}, "the last group came before the trainers' verdict"
        if position in ("middle", "middle-rank1"):  # nothing streamed from the refused tensor on
            assert all(streamed.index(streamed_as(n)) < at for n in got), sorted(got)
        if position == "missing":
            assert not {n for n in got if streamed_as(n) == FUSED}, "a tensor that never came was handed on"
        # what was handed on is the new version, byte for byte; the rest is the old one
        wrong = sorted(n for n in old if digests[n] != (want[n] if n in got else old[n]))
        assert not wrong, f"rollout rank {r}: {wrong[:3]}"

    start = time.monotonic()
    cluster.refit(step)  # the next complete refit restores a whole version everywhere
    print(f"{position}/{staging}/{transport}: the next refit {time.monotonic() - start:.2f} s")
    check_serves(cluster, step)
