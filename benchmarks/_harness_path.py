"""The benchmarks that use the test suite's harness (tests/harness, imported as `harness`) import this first: it
puts this checkout and tests/ on the import path of this process and, through PYTHONPATH, of every process it starts
(world processes, servers, Ray workers). A script run as `python benchmarks/x.py` has benchmarks/ on its path."""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (str(ROOT / "tests"), str(ROOT)):
    if _path not in sys.path:
        sys.path.insert(0, _path)
os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(filter(None, [
    str(ROOT), str(ROOT / "tests"), *os.environ.get("PYTHONPATH", "").split(os.pathsep)])))
