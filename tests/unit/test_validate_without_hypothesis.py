"""`reshard validate` is a user's command: it runs where hypothesis (a test dependency) is not installed. A fresh
interpreter whose imports of hypothesis fail runs the CLI's discovery and round-trip stages and passes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A meta-path finder that refuses hypothesis, then the CLI (what the `reshard` console script runs).
WITHOUT_HYPOTHESIS = """
import sys
class NoHypothesis:
    def find_spec(self, name, path=None, target=None):
        if name == "hypothesis" or name.startswith("hypothesis."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
sys.meta_path.insert(0, NoHypothesis())
for name in [m for m in sys.modules if m == "hypothesis" or m.startswith("hypothesis.")]:
    del sys.modules[name]
from reshard.cli import main  # the console script `reshard`
sys.exit(main(sys.argv[1:]))
"""


def test_validate_runs_without_hypothesis():
    out = subprocess.run([sys.executable, "-c", WITHOUT_HYPOTHESIS, "validate", "--model",
                          "examples/configs/qwen3-30b-a3b.json", "--stages", "round trip", "--examples", "4",
                          "--json"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = {r["stage"]: r for r in json.loads(out.stdout.strip().splitlines()[-1])}
    assert results["discovery"]["status"] == "pass", results
    assert results["round trip"]["status"] == "pass", results
    assert results["round trip"]["detail"].startswith("4 random layout pairs"), results


def test_blocked_hypothesis_is_really_unimportable():
    out = subprocess.run([sys.executable, "-c", WITHOUT_HYPOTHESIS.replace(
        "from reshard.cli import main", "import hypothesis")],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "blocked by the test" in out.stderr
