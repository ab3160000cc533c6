"""The validation workflow on tiny instances of every registered family: discovery and the round-trip property
run everywhere; Megatron layout parity and HF parity against real megatron-core models and transformers (marker
megatron); vLLM layout parity and vLLM load parity against real vLLM model code (marker vllm; runs in the vLLM
venv). A stage that cannot run must say "not run", and here that fails the test of that stage; negative tests
corrupt one tensor on reshard's side and require FAIL naming it."""
from __future__ import annotations

import pytest

from reshard.layouts.families import discover, family, read_hf_config, registered_families
from reshard.validate import FAIL, NOT_RUN, PASS, mismatch_config, validate

# One example config per registered family (examples/configs); kimi-k2 shares the deepseek_v3 family, the dense
# Qwen3.6 the qwen3_5 family of the MoE Qwen3.5.
CONFIGS = {
    "qwen3": "examples/configs/qwen3-0.6b.json",
    "llama": "examples/configs/llama-3.1-70b.json",
    "qwen3_moe": "examples/configs/qwen3-30b-a3b.json",
    "deepseek_v3": "examples/configs/deepseek-v3.json",
    "qwen3_5": "examples/configs/qwen3.5-35b-a3b.json",
}
EXTRA = ["examples/configs/kimi-k2.json", "examples/configs/qwen3.6-27b.json"]


def test_every_built_in_family_has_a_validation_config():
    built_in = [n for n in registered_families() if type(family(n)).__module__.startswith("reshard.layouts.families.")]
    assert sorted(CONFIGS) == built_in
    for name, path in CONFIGS.items():
        assert discover(read_hf_config(path)).name == name


def _one(config: str, stage: str, **kw):
    results = {r.stage: r for r in validate(config, stages=[stage], **kw)}
    assert results["discovery"].status == PASS, results["discovery"].detail
    return results[stage]


@pytest.mark.parametrize("config", [*CONFIGS.values(), *EXTRA])
def test_round_trip_stage(config):
    r = _one(config, "round trip", examples=8)
    assert r.status == PASS, r.detail


@pytest.mark.megatron
@pytest.mark.parametrize("config", [CONFIGS["qwen3_moe"], CONFIGS["deepseek_v3"], CONFIGS["llama"],
                                    CONFIGS["qwen3_5"], EXTRA[1]])
def test_megatron_layout_stage(config):
    r = _one(config, "megatron layout")
    assert r.status == PASS, r.detail


# MLA, MoE with expert bias and GDN: the families whose vLLM names or shapes differ most from HF's. One vLLM process
# builds the three in turn (its start and vLLM's import are most of the time); validate()'s own path runs for one.
VLLM_LAYOUT = [CONFIGS["deepseek_v3"], CONFIGS["qwen3_moe"], CONFIGS["qwen3_5"]]


@pytest.mark.vllm
def test_vllm_layout_stage():
    import sys

    from reshard.validate import vllm_layout_summary
    from reshard.validate import side_reports

    r = _one(VLLM_LAYOUT[0], "vllm layout")
    assert r.status == PASS, r.detail
    fams = [discover(read_hf_config(c)) for c in VLLM_LAYOUT[1:]]
    tinies = [f.tiny_config(read_hf_config(c)) for f, c in zip(fams, VLLM_LAYOUT[1:])]
    for f, tiny, report in zip(fams, tinies, side_reports(tinies, sys.executable)):
        assert "names and shapes equal" in vllm_layout_summary(f.spec(tiny), report[1][0]), f.name


def test_stages_without_their_dependency_say_not_run(monkeypatch):
    import reshard.validate as v

    monkeypatch.setattr(v, "_has", lambda module: module not in ("megatron.core", "vllm"))
    monkeypatch.delenv("RESHARD_VLLM_CPU_PYTHON", raising=False)
    results = {r.stage: r for r in validate(CONFIGS["qwen3"], stages=["megatron layout", "hf parity",
                                                                      "vllm load parity", "mismatch"],
                                            vllm_cpu_python="/nonexistent/.venv-vllm-cpu/bin/python")}
    for stage in ("megatron layout", "hf parity", "vllm load parity", "mismatch"):
        assert results[stage].status == NOT_RUN and results[stage].detail, results[stage]
    assert "megatron.core" in results["hf parity"].detail
    assert "--vllm-python" in results["vllm load parity"].detail
    assert "no vLLM CPU virtualenv at /nonexistent" in results["mismatch"].detail
    assert "--vllm-cpu-python" in results["mismatch"].detail


# --- hf parity: megatron-core (TP=2 [EP=2]) -> reshard -> transformers logits, every family ------------------

# Qwen3.5/3.6: Megatron keeps the GDN output norm zero-centred (it stores w - 1) while HF's gated
# linear_attn.norm computes with w itself; the plan carries that as a value shift (+1 on linear_attn.norm.weight,
# Plan.value_shifts), so the refit's logits match. Without the shift (a pure re-layout) they differ at the first
# GDN layer.
GDN_NORM_SHIFT = {CONFIGS["qwen3_5"], EXTRA[1]}


@pytest.mark.megatron
@pytest.mark.parametrize("config", [*CONFIGS.values(), *EXTRA])
def test_hf_parity_stage(config):
    r = _one(config, "hf parity")
    assert r.status == PASS, r.detail


@pytest.mark.megatron
@pytest.mark.parametrize("config", sorted(GDN_NORM_SHIFT))
def test_hf_parity_needs_the_gdn_out_norm_shift(config):
    """One megatron-core run; transformers on the refit's weights matches, and on the same weights without the
    plan's +1 on every GDN out norm (linear_attn.norm.weight), and nothing else changed, differs at layer 0."""
    from reshard.validate.hf_parity import compare, megatron_run

    fam = discover(read_hf_config(config))
    tiny = fam.tiny_config(read_hf_config(config))
    layout, weights, meg = megatron_run(fam.spec(tiny), tiny)
    assert "match megatron-core's" in compare(layout, tiny, weights, meg)
    gdn = [n for n in weights if n.endswith("linear_attn.norm.weight")]
    assert len(gdn) == 3  # the tiny model's three linear-attention layers
    unshifted = {n: t - 1.0 if n in gdn else t for n, t in weights.items()}
    with pytest.raises(AssertionError, match="first differing output: layer 0 "):
        compare(layout, tiny, unshifted, meg)


@pytest.mark.megatron
@pytest.mark.parametrize("family,tensor,layer", [
    ("deepseek_v3", "model.layers.1.self_attn.kv_b_proj.weight", 1),  # MLA, TP row blocks
    ("qwen3_moe", "model.layers.2.mlp.experts.3.down_proj.weight", 2),  # an expert of EP rank 1
])
def test_hf_parity_stage_fails_on_a_corrupted_tensor(family, tensor, layer):
    """The refit's HF weights with one tensor corrupted (two rows swapped): the stage must say FAIL and point
    at the layer holding it."""
    r = _one(CONFIGS[family], "hf parity", perturb={"hf parity": tensor})
    assert r.status == FAIL, r.detail
    assert "logits differ" in r.detail and f"first differing output: layer {layer} " in r.detail, r.detail


# --- vllm load parity: vLLM's load_weights vs reshard's direct install, TP=1 and TP=2, every family ----------

# DeepSeek-V3's router bias (e_score_correction_bias) is float32 in checkpoints and in a bf16 vLLM model: the plan
# moves it in its own dtype (as bf16 units), so vLLM's loader and reshard's install agree byte for byte in bf16
# too. (Qwen3.5's A_log, float32 in vLLM but model dtype in checkpoints, passes through the install's cast.)
# One launch of vLLM processes (TP=1 and TP=2) checks every family and the negative case in turn: a process's
# start, vLLM's import and the distributed set-up are most of a check's time. One test, so that the AMX-path rerun
# (which re-runs the tests whose processes consulted the AMX checks) re-checks every family. The stage's own path
# through validate() (one config) is the negative case below, and test_stages_without_their_dependency_say_not_run.
CORRUPTED = ("qwen3_moe", "model.layers.1.mlp.experts.2.gate_proj.weight")


@pytest.mark.vllm
def test_vllm_load_parity_stage_every_family():
    """Every family's direct and loader installs equal vLLM's load_weights byte for byte at TP=1 and TP=2; with
    one canonical tensor corrupted (two rows swapped), FAIL naming the vLLM parameter on the rank holding those
    rows (TP=2 rank 0 holds rows 0 and 1 of every expert's gate_proj)."""
    import sys

    from reshard.validate import load_parity_summary, side_reports

    tinies = []
    for name in [*CONFIGS, CORRUPTED[0]]:
        config = read_hf_config(CONFIGS[name])
        tinies.append(discover(config).tiny_config(config))
    reports = side_reports(tinies, sys.executable, "load_parity", {len(CONFIGS): CORRUPTED[1]}, worlds=(1, 2))
    failed = {}
    for name, rep in zip(CONFIGS, reports):
        try:
            detail = load_parity_summary(rep)
        except AssertionError as exc:
            failed[name] = str(exc)
            continue
        assert "vllm:tp=1" in detail and "vllm:tp=2" in detail, (name, detail)
    assert not failed, failed
    with pytest.raises(AssertionError) as info:
        load_parity_summary(reports[-1])
    w13 = "model.layers.1.mlp.experts.routed_experts.w13_weight"
    assert str(info.value).endswith(f"vllm:tp=2,replicas=1 rank 0: {w13}, {w13} (loader install)"), info.value


@pytest.mark.vllm
def test_vllm_load_parity_stage_through_validate():
    """The stage as `reshard validate` runs it (one config; TP=1 only here): a corrupted tensor is a FAIL row."""
    r = _one(CONFIGS["qwen3"], "vllm load parity", vllm_worlds=(1,),
             perturb={"vllm load parity": "model.layers.1.self_attn.o_proj.weight"})
    assert r.status == FAIL, r.detail
    assert "vllm:tp=1" in r.detail and "o_proj.weight" in r.detail, r.detail


# --- mismatch: an in-process vLLM CPU engine refit by reshard, against the same engine started fresh ----------

# Each case starts a whole vLLM engine on CPU in the vLLM CPU virtualenv (about 17 s on 2 cores). Qwen3 and
# DeepSeek-V3 run in CI: besides the refit (which must equal the engine started fresh), each must agree with
# transformers on the same weights within the float32 thresholds, an independent implementation, and DeepSeek-V3 is
# the only MLA model code (and DeepSeek yarn rotary) checked so (reshard/validate/vllm_side.py). The negative
# case is slow (its path is the Qwen3 case's).
@pytest.mark.vllm
@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_mismatch_stage(family):
    r = _one(CONFIGS[family], "mismatch")
    print(f"{family}: {r.detail}")
    assert r.status == PASS, r.detail
    assert "train-inference mismatch (float32" in r.detail and "-> ok" in r.detail, r.detail
    assert "other weights flagged" in r.detail, r.detail
    assert "(within the float32 thresholds)" in r.detail, r.detail


def test_mismatch_config_keeps_the_models_rope_scaling():
    """DeepSeek-V3's tiny instance drops its yarn rope scaling; the mismatch stage's
    engine gets it back (vLLM's DeepSeek yarn rotary, not the plain one); a config without one is left as it is."""
    for family, want in (("deepseek_v3", "yarn"), ("qwen3", None)):
        config = read_hf_config(CONFIGS[family])
        tiny = discover(config).tiny_config(config)
        assert tiny.get("rope_scaling") is None
        out = mismatch_config(tiny, config)
        assert (out.get("rope_scaling") or {}).get("type") == want, (family, out.get("rope_scaling"))
        assert out["torch_dtype"] == "float32" and out["hidden_size"] == tiny["hidden_size"]


@pytest.mark.vllm
@pytest.mark.slow
def test_mismatch_stage_fails_on_a_corrupted_tensor():
    """The refit's source with one tensor corrupted (two rows of an attention projection swapped): FAIL."""
    r = _one(CONFIGS["qwen3"], "mismatch", perturb={"mismatch": "model.layers.1.self_attn.o_proj.weight"})
    assert r.status == FAIL and "after the refit" in r.detail and "MISMATCH" in r.detail, r.detail


def test_unknown_architecture_lists_the_supported_ones():
    results = validate({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, stages=["round trip"])
    assert results[0].status == FAIL and "DeepseekV3ForCausalLM" in results[0].detail
    assert results[1].status == NOT_RUN


@pytest.mark.megatron
def test_hf_parity_stage_says_not_run_for_a_setting_megatron_core_cannot_build(tmp_path):
    """A config whose rope scaling (YaRN) has no megatron-core GPTModel equivalent here: the stage says "not run"
    and names the setting, rather than failing in its ranks (it did: the refusal was raised in the rank
    processes, and reached the stage as a failed rank)."""
    import json

    config = read_hf_config(CONFIGS["qwen3"])
    path = tmp_path / "config.json"
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    path.write_text(json.dumps({**config, "rope_scaling": yarn}))
    r = _one(str(path), "hf parity")
    assert r.status == NOT_RUN and "has no megatron-core GPTModel equivalent" in r.detail, r.detail
