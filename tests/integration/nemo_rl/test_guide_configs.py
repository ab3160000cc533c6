"""The configs users paste from docs/guides/nemo_rl.md, run through NeMo-RL's config machinery as recorded from its
source (tests/data/nemo_rl_checkpoint_engine.json, `config`) and then through refits.

Every ```yaml block of the guide must be marked `<!-- test: nemo-rl-config -->` (an unmarked config block fails
here, so none goes untested). Each marked block is parsed (PyYAML: NeMo-RL loads with OmegaConf, whose defaults
files and interpolation are not replayed), its `policy.generation` checked as NeMo-RL checks it, its refit_cfg
entry validated by a model built from the recorded schema of `VllmCheckpointEnginePluginConfig` (extra keys
allowed, the ratio's bounds, the booleans), dumped without the recorded excluded fields into the keyword arguments
NeMo-RL passes, with the bucket size by NeMo-RL's recorded rule; the class is imported from the class path as
NeMo-RL's `create_checkpoint_engine` does. Those exact keyword arguments then build the engines of 2 policy and 2
vLLM worker processes (harness.nemo_rl_jobs, NeMo-RL's call order) and two refits must give every vLLM worker the
checkpoint's trained tensors, byte for byte. The placeholder model path is the only thing replaced.

Bad input as NeMo-RL would pass it: a key reshard does not take and a host that is no address of this node are
refused at construction, naming them; a block missing what NeMo-RL requires is refused by the checks.
"""
from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from typing import Annotated, Any

import pydantic
import pytest
import yaml

from reshard.errors import ArgumentError
from reshard.testing.megatron_cpu import TinyGPT
from harness.serve_jobs import make_checkpoint
from reshard.testing.world import run_world

pytestmark = pytest.mark.gloo

ROOT = Path(__file__).resolve().parents[3]
GUIDE = ROOT / "docs/guides/nemo_rl.md"
RECORD = json.loads((ROOT / "tests/data/nemo_rl_checkpoint_engine.json").read_text())["config"]
MARK = "<!-- test: nemo-rl-config -->"
PLACEHOLDER = "/path/to/the/checkpoint"
FENCE = re.compile(r"^```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^```", re.S | re.M)
GPU_MEMORY = 80 * 1024**3  # the smallest worker's total GPU memory in NeMo-RL's bucket rule (an 80 GiB card)
JOB = "harness.nemo_rl_jobs:nemo_rl_worker"


def config_blocks() -> list[tuple[int, bool, str]]:
    """Every yaml block of the guide: (line, marked for this test, text)."""
    text = GUIDE.read_text()
    blocks = []
    for m in FENCE.finditer(text):
        if m["lang"] in ("yaml", "yml"):
            before = text[:m.start()].rstrip().rsplit("\n", 1)[-1].strip()
            blocks.append((text.count("\n", 0, m.start()) + 1, before == MARK, m["body"]))
    return blocks


TESTED = [(line, body) for line, marked, body in config_blocks() if marked]


def _plugin_model() -> type[pydantic.BaseModel]:
    """`VllmCheckpointEnginePluginConfig` rebuilt from the recorded schema (its types, defaults, bounds, extra)."""
    schema = RECORD["plugin_config"]
    types = {"float": float, "bool": bool, "int": int, "str": str}
    fields: dict[str, Any] = {}
    for name, f in schema["fields"].items():
        fields[name] = (Annotated[types[f["type"]], pydantic.Field(**f["constraints"])], f["default"])
    return pydantic.create_model(schema["class"], __config__=pydantic.ConfigDict(extra=schema["extra"]), **fields)


def _get(config: dict[str, Any], dotted: str) -> Any:
    for key in dotted.split("."):
        if not isinstance(config, dict) or key not in config:
            raise KeyError(dotted)
        config = config[key]
    return config


def nemo_rl_engine_call(text: str, checkpoint: str) -> tuple[type, int, dict[str, Any]]:
    """What NeMo-RL does with a config before the engine exists: (the class, bucket_size, the keyword arguments).
    Raises ValueError (NeMo-RL's checks) or pydantic.ValidationError (its schema)."""
    generation = yaml.safe_load(text.replace(PLACEHOLDER, checkpoint))["policy"]["generation"]
    transport = generation.get("refit_transport")
    for check in RECORD["checks"]:
        key = check["key"]
        if key == "refit_cfg[refit_transport]":
            if (generation.get("refit_cfg") or {}).get(transport) is None:
                raise ValueError(f"policy.generation.refit_cfg[{transport!r}] is required ({check['where']})")
            continue
        try:
            value = _get(generation, key)
        except KeyError:
            want = check.get("equals", f"a value containing {check.get('contains')!r}")
            raise ValueError(f"policy.generation.{key} is not set in this block: NeMo-RL needs {want!r} there "
                             f"({check['where']}); a pasted block states it, whatever config it lands in") from None
        if "equals" in check and value != check["equals"]:
            raise ValueError(f"policy.generation.{key} must be {check['equals']!r} ({check['where']})")
        if "contains" in check and check["contains"] not in str(value):
            raise ValueError(f"policy.generation.{key} must contain {check['contains']!r} ({check['where']})")
    plugin = _plugin_model().model_validate(generation["refit_cfg"][transport])
    kwargs = plugin.model_dump(exclude=set(RECORD["engine_kwargs_exclude"]))
    unit = RECORD["bucket_size"]["unit"]
    bucket_size = int(GPU_MEMORY * plugin.update_weights_bucket_memory_ratio) // unit * unit
    module, name = transport.split(":", 1)  # create_checkpoint_engine: importlib, then getattr
    return getattr(importlib.import_module(module), name), bucket_size, kwargs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_checkpoint(TinyGPT(), tmp_path_factory.mktemp("nemo-rl-guide") / "dense"))


def test_every_config_block_of_the_guide_is_tested():
    blocks = config_blocks()
    unmarked = [line for line, marked, _ in blocks if not marked]
    assert not unmarked, f"{GUIDE.name}: config blocks at lines {unmarked} are not marked {MARK!r}"
    assert len(TESTED) >= 2  # the minimal config and the one with every option
    for line, body in TESTED:
        assert PLACEHOLDER in body, f"line {line}: the model path must be {PLACEHOLDER} (the test replaces it)"


@pytest.mark.parametrize("line,body", TESTED, ids=[f"line{line}" for line, _ in TESTED])
def test_a_guide_config_builds_the_engines_nemo_rl_would_and_refits(tmp_path, checkpoint, line, body):
    cls, bucket_size, kwargs = nemo_rl_engine_call(body, checkpoint)
    assert "host" not in kwargs  # the config names no node
    assert "release_after_refit" in kwargs and "update_weights_bucket_memory_ratio" not in kwargs  # as NeMo-RL dumps
    cls(bucket_size=bucket_size, **kwargs).finalize()  # construction alone: what init_checkpoint_engine does
    job = {"checkpoint": checkpoint, "policy": 2, "rollout": 2, "steps": 2, "dir": str(tmp_path),
           "engine_kwargs": kwargs, "bucket_size": bucket_size,
           "release_after_refit": kwargs["release_after_refit"]}
    results = run_world(4, JOB, job, tmp_path, timeout=240)
    assert all(r is not None for r in results), (tmp_path / "logs.txt").read_text()[-4000:]
    policy, rollout = results[:2], results[2:]
    for r in results:
        assert "construct_error" not in r and "meet_error" not in r, r
    for r in rollout:
        assert [e["step"] for e in r["refits"]] == [1, 2]
        for entry in r["refits"]:
            assert "error" not in entry, entry
            assert entry["equal"], entry["wrong"]
    assert all(p["refits"][-1]["bytes_sent"] > 0 for p in policy)  # the sending is spread over both


def _edit(body: str, add: str = "", drop: str = "") -> str:
    """The first tested block with a line added to (or every line containing `drop` removed from) its entry."""
    lines = [ln for ln in body.splitlines() if not (drop and drop in ln)]
    if add:
        at = next(i for i, ln in enumerate(lines) if "model:" in ln)
        lines.insert(at + 1, " " * (len(lines[at]) - len(lines[at].lstrip())) + add)
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("add,words", [
    ("fan_out: 2", r"refit_cfg key 'fan_out' is not an option.*did you mean 'fan_out' -> 'fanout'"),
    ("host: 198.51.100.1", r"refit_cfg host='198\.51\.100\.1' is not an address of this host.*remove `host`"),
    # refit while the engine generates: NeMo-RL runs the whole refit inside one vLLM collective_rpc (nemo_rl.md)
    ("pause_for: flip", r"refit_cfg pause_for='flip' is reshard's refit while the engine generates.*collective_rpc"
                        r".*checkpoint_engine_weight_synchronizer\.py:225-231.*docs/guides/nemo_rl\.md"),
    ("staging: device", r"refit_cfg staging='device' is reshard's refit while the engine generates.*no progress"),
], ids=["unknown-key", "another-nodes-host", "pause-for-flip", "staging-device"])
def test_a_key_nemo_rl_would_pass_that_reshard_refuses_is_named(checkpoint, add, words):
    """NeMo-RL's schema lets both through (extra keys allowed); the engine refuses them when it is built."""
    cls, bucket_size, kwargs = nemo_rl_engine_call(_edit(TESTED[0][1], add=add), checkpoint)
    assert add.split(":")[0] in kwargs  # NeMo-RL passed it on
    with pytest.raises(ArgumentError, match=words):
        cls(bucket_size=bucket_size, **kwargs)


def test_what_nemo_rl_refuses_before_the_engine_exists(checkpoint):
    """The recorded machinery is not a pass-through: what NeMo-RL refuses, it refuses."""
    body = TESTED[0][1]
    with pytest.raises(ValueError, match="colocated.enabled must be False"):
        nemo_rl_engine_call(body.replace("{enabled: false}", "{enabled: true}"), checkpoint)
    with pytest.raises(pydantic.ValidationError, match="update_weights_bucket_memory_ratio"):
        nemo_rl_engine_call(_edit(body, add="update_weights_bucket_memory_ratio: 1.5"), checkpoint)
    with pytest.raises(ValueError, match=r"refit_cfg\[.*\] is required"):
        nemo_rl_engine_call(body.replace('"reshard.integrations.nemo_rl:ReshardCheckpointEngine":',
                                         '"reshard.integrations.nemo_rl:Other":'), checkpoint)
    cls, bucket_size, kwargs = nemo_rl_engine_call(_edit(TESTED[-1][1], drop="model:"), checkpoint)
    with pytest.raises(ArgumentError, match="model"):
        cls(bucket_size=bucket_size, **kwargs)
