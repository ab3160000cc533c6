"""The verl tests run in the verl virtualenv (scripts/test's verl stage, `-m verl`); elsewhere they are not
collected (verl pins another transformers than the core virtualenv). In the verl stage a missing verl fails the
run: it collects nothing and pytest exits 5. Whether verl is installed is asked of the installed distributions:
a module lookup would find this very folder (named verl) as a namespace package."""
import importlib.metadata


def _verl_installed() -> bool:
    try:
        importlib.metadata.version("verl")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


collect_ignore_glob = [] if _verl_installed() else ["test_*.py"]
