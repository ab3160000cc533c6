"""ReshardCheckpointEngine against NeMo-RL's checkpoint-engine interface, recorded as data from NeMo-RL's source
at a pinned commit (tests/data/nemo_rl_checkpoint_engine.json, made by scripts/record_nemo_rl_interface.py).

Fails when the recorded interface changes (re-recorded at another commit: review the difference, then update
PINNED) or when the class drifts from it: a method missing, a parameter renamed or of another kind, a sync method
made async or the reverse, the async generator no longer one. Also checks the pure logic NeMo-RL relies on:
construction from `bucket_size` plus the plugin config's keywords, and the target layout's shape.
"""
from __future__ import annotations

import hashlib
import inspect
import json
from pathlib import Path

import pytest

from reshard.errors import ArgumentError, ExecutionError
from reshard.integrations.nemo_rl import ReshardCheckpointEngine
from reshard.testing.megatron_cpu import TinyGPT

DATA = Path(__file__).resolve().parents[1] / "data/nemo_rl_checkpoint_engine.json"
PINNED = {"commit": "7ea279abfbeb698b092856d0dab61e7cf39bc909",
          "interface_sha256": "c910d9823dcd10f3be652c6c6f78c48f34d31b220290d76c03faff351144a15c",
          # how a YAML config becomes the constructor call (the guide's configs run through it)
          "config_sha256": "03cfbe6f3df7949b8d646955f7dda7e1f3d5c0788838972d92a07cf90dd3c0af"}


@pytest.fixture(scope="module")
def interface():
    return json.loads(DATA.read_text())


def test_the_recorded_interface_is_the_pinned_one(interface):
    assert interface["source"]["commit"] == PINNED["commit"]
    body = {k: interface[k] for k in ("constructor", "methods", "attributes", "typed_dicts")}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    assert digest == PINNED["interface_sha256"], "NeMo-RL's recorded interface changed: review it, then re-pin"
    digest = hashlib.sha256(json.dumps(interface["config"], sort_keys=True).encode()).hexdigest()
    assert digest == PINNED["config_sha256"], "NeMo-RL's recorded config machinery changed: review it, then re-pin"


def test_the_recorded_config_is_what_construction_relies_on(interface):
    """The plugin config passes extra keys through (reshard's options reach the constructor only so), and every
    field it declares is either dumped into the keyword arguments or excluded from them."""
    config = interface["config"]
    plugin = config["plugin_config"]
    assert plugin["extra"] == "allow"
    assert sorted(plugin["fields"]) == sorted(interface["constructor"]["plugin_config_fields"])
    assert config["engine_kwargs_exclude"] == interface["constructor"]["excluded_from_kwargs"]
    passed = set(plugin["fields"]) - set(config["engine_kwargs_exclude"])
    params = inspect.signature(ReshardCheckpointEngine).parameters
    assert passed <= set(params), f"NeMo-RL always passes {sorted(passed)}"


def test_every_method_matches_the_recorded_signature(interface):
    for name, want in interface["methods"].items():
        fn = getattr(ReshardCheckpointEngine, name, None)
        assert callable(fn), f"{name} is missing"
        params = list(inspect.signature(fn).parameters.values())[1:]  # without self
        got = [{"name": p.name, "kind": p.kind.name, "has_default": p.default is not inspect.Parameter.empty}
               for p in params]
        assert got == want["params"], f"{name}: {got} != {want['params']}"
        assert inspect.iscoroutinefunction(fn) == want["async"], name
        assert inspect.isasyncgenfunction(fn) == want["async_iterable"], name


def test_class_attributes(interface):
    for name, want in interface["attributes"].items():
        value = getattr(ReshardCheckpointEngine, name)
        assert type(value).__name__ == want["annotation"], name


def test_constructed_as_nemo_rl_constructs_it(interface, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(TinyGPT().hf_config().to_json_string())
    kwargs = {f: False for f in interface["constructor"]["plugin_config_fields"]
              if f not in interface["constructor"]["excluded_from_kwargs"]}
    engine = ReshardCheckpointEngine(**{interface["constructor"]["keywords"][0]: 1 << 20}, model=str(config),
                                     **kwargs)
    assert engine.get_target_weight_layout() is None  # not a joined policy worker
    with pytest.raises(ArgumentError, match="model"):
        ReshardCheckpointEngine(bucket_size=1 << 20)
    with pytest.raises(ArgumentError, match="bucket_size"):
        ReshardCheckpointEngine(bucket_size=0, model=str(config))
    with pytest.raises(ArgumentError, match="transport"):
        ReshardCheckpointEngine(bucket_size=1 << 20, model=str(config), transport="carrier-pigeon")
    with pytest.raises(ArgumentError, match=r"'fan_out' is not an option.*'fan_out' -> 'fanout'"):
        ReshardCheckpointEngine(bucket_size=1 << 20, model=str(config), fan_out=2)  # NeMo-RL passes any key
    with pytest.raises(ArgumentError, match=r"host='198\.51\.100\.77' is not an address of this host.*RESHARD_HOST"):
        ReshardCheckpointEngine(bucket_size=1 << 20, model=str(config), host="198.51.100.77")  # TEST-NET-2: no host's


def test_options_are_checked_at_construction(tmp_path):
    """staging and transport, and the options that do not fit them, refused by name before any worker joins."""
    config = tmp_path / "config.json"
    config.write_text(TinyGPT().hf_config().to_json_string())
    for kwargs, words in [({"staging": "all"}, r"staging='all' must be one of \('bucket', 'model'\)"),
                          ({"transport": "shared", "fanout": 2}, "fanout=2 is the collective transport's"),
                          ({"transport": "shared", "backend": "gloo"}, "backend='gloo' is the collective"),
                          ({"device": "cpu", "backend": "nccl"}, "backend='nccl' does not move tensors on cpu"),
                          ({"checksum": "md5"}, "checksum='md5'"),
                          ({"delta": 2}, r"delta=2 needs staging: model \(the buckets of staging bucket are reused"),
                          ({"delta": 0, "staging": "model"}, r"delta=0 must be K in \[1, 2\^30\]"),
                          ({"delta": True, "staging": "model"}, "delta=True has type bool"),
                          ({"delta": 2, "staging": "model", "fanout": 1}, "delta=2 needs fanout unset"),
                          ({"delta": 2, "staging": "model", "release_after_refit": True},
                           "delta=2 with release_after_refit: NeMo-RL then finalizes after every refit")]:
        with pytest.raises(ArgumentError, match=words):
            ReshardCheckpointEngine(bucket_size=1 << 20, model=str(config), **kwargs)
    engine = ReshardCheckpointEngine(bucket_size=1 << 20, model=str(config), transport="shared", device="cpu")
    assert engine.checksum is True  # on by default (sha256 on CPU; sum64 on GPUs)
    assert engine.get_target_weight_layout() is None  # NeMo-RL then filters nothing (benchmarks/nemo_rl_filter.py)


def test_model_staging_larger_than_free_memory_is_refused_when_a_vllm_worker_joins(tmp_path):
    """DeepSeek-V3 (1.3 TB in bf16) staged whole on this host's CPU: refused with both numbers and the fix, and
    the failure is posted to the rendezvous so that the workers waiting in it stop at once."""
    from reshard.adapters import rendezvous as rv

    config = Path(__file__).resolve().parents[2] / "examples/configs/deepseek-v3.json"
    engines = [ReshardCheckpointEngine(bucket_size=1 << 30, model=str(config), staging="model", device="cpu",
                                       host="127.0.0.1") for _ in range(2)]
    assert engines[1].model_bytes > 1 << 40 and engines[1].free_bytes < engines[1].model_bytes
    try:
        metadata = [e.prepare() for e in engines]
        with pytest.raises(ArgumentError, match=r"staging='model' holds the whole model on every vLLM worker: "
                                                 r"1249\.\d\d GiB .*but cpu had .* GiB .* free.*staging: bucket"):
            engines[1].init_rollout_process_group(rollout_rank=0, train_world_size=1, rollout_world_size=1,
                                                  metadata=metadata)
        assert "staging='model'" in rv.failure(engines[0].store, engines[0].offer)
    finally:
        for e in engines:
            e.finalize()


def test_bad_topology_is_refused_before_joining(tmp_path):
    """Untrusted metadata and sizes are checked before this worker meets anyone (nothing else runs here)."""
    config = tmp_path / "config.json"
    config.write_text(TinyGPT().hf_config().to_json_string())
    engine = ReshardCheckpointEngine(bucket_size=1 << 20, model=str(config), host="127.0.0.1")
    other = ReshardCheckpointEngine(bucket_size=1 << 20, model=str(config), host="127.0.0.1", fanout=2)
    with pytest.raises(ExecutionError, match="prepare"):
        engine.init_policy_process_group(worker_rank=0, train_world_size=1, rollout_world_size=1,
                                         metadata=[{"reshard": engine._settings()}] * 2)
    mine, theirs = engine.prepare(), other.prepare()
    try:
        cases = [({"worker_rank": 0, "train_world_size": 1, "rollout_world_size": 1, "metadata": [mine]}, "per worker"),
                 ({"worker_rank": 0, "train_world_size": 1, "rollout_world_size": 1, "metadata": [mine, theirs]},
                  "other settings"),
                 ({"worker_rank": 2, "train_world_size": 2, "rollout_world_size": 1, "metadata": [mine] * 3},
                  "worker_rank"),
                 ({"worker_rank": 0, "train_world_size": 0, "rollout_world_size": 1, "metadata": [mine]},
                  "train_world_size"),
                 ({"worker_rank": 1, "train_world_size": 2, "rollout_world_size": 1, "metadata": [mine, mine, "x"]},
                  "other settings")]
        for kwargs, words in cases:
            with pytest.raises(ArgumentError, match=words):
                engine.init_policy_process_group(**kwargs)
        assert engine.role is None
    finally:
        engine.finalize()
        other.finalize()
