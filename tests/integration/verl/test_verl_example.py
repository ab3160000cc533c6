"""examples/verl/refit.py, the verl user path, runs in one command and exits 0 (it exits 1 unless every rollout
worker holds exactly the trainer's weights after each step)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.verl
def test_verl_example_refits_every_rollout_worker():
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, str(ROOT / "examples/verl/refit.py"), "--steps", "2"], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=path), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.stdout.strip().splitlines()[-1] == "OK", done.stdout[-2000:]
