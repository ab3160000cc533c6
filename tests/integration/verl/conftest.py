"""The verl tests run in the verl virtualenv (scripts/test's verl stage, `-m verl`); elsewhere they are not
collected (verl pins another transformers than the core virtualenv). In the verl stage a missing verl fails the
run: it collects nothing and pytest exits 5."""
import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("verl") else ["test_*.py"]
