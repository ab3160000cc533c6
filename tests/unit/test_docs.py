"""The manual cannot rot: the docs site builds in strict mode (broken links and references fail), every Python
snippet of the README and the docs runs, and every public name documents itself (summary, Args, Returns,
Raises)."""
from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# the packages whose exported names (__all__) the API reference renders: Google style (summary, Args, Returns, Raises)
PUBLIC_MODULES = ("reshard", "reshard.adapters", "reshard.executors", "reshard.integrations.nemo_rl",
                  "reshard.integrations.verl", "reshard.layouts", "reshard.planner", "reshard.verify")
SNIPPET = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def pages() -> list[Path]:
    """The README and the docs pages that hold python snippets."""
    return [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))] if SNIPPET.search(p.read_text())]


def test_docs_site_builds_strictly(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                          "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    for page in ("reshard", "layouts", "planner", "executors", "adapters", "integrations", "verify"):
        assert (tmp_path / "site" / "reference" / page / "index.html").exists(), page


INCLUDE = re.compile(r'^--8<-- "([^":]+):([\w-]+)"$')
# a guide's included code is an example's (run by the example tests, public API only), never the test harness's
TESTED_SOURCES = ("examples/",)


def included(block: str) -> tuple[str, str] | None:
    """(file, section) of a block that only includes a marked section of a file (pymdownx.snippets)."""
    m = INCLUDE.match(block.strip())
    return (m.group(1), m.group(2)) if m else None


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_python_snippets_run(page, tmp_path):
    """A page's ```python blocks run in order in one fresh interpreter from the repository root (a later block may
    use an earlier one's names); a block that shows a refusal catches it itself. A block that includes a marked
    section of an example (run by the example tests) is that file's code: the section must exist."""
    blocks = []
    for block in SNIPPET.findall(page.read_text()):
        source = included(block)
        if source is None:
            blocks.append(block)
            continue
        path, section = source
        assert path.startswith(TESTED_SOURCES), (f"{page.name} includes {path}: guides include examples only "
                                                 "(public API, run by the example tests)")
        text = (ROOT / path).read_text()
        assert f"[start:{section}]" in text and f"[end:{section}]" in text, f"{path} has no section {section}"
    if not blocks:
        return  # every snippet of this page is an included section, checked above
    script = tmp_path / "snippets.py"
    script.write_text("\n\n".join(f"# --- block {i + 1}\n{b}" for i, b in enumerate(blocks)))
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{page.name}: a snippet failed:\n{out.stderr[-3000:]}"


def public_names() -> list[tuple[str, str, object]]:
    names = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            names.append((module_name, name, getattr(module, name)))
    return names


def doc_problems(obj: object) -> list[str]:
    """What a public name's docstring lacks, in the Google style the API reference renders (a type alias is
    documented where it is defined, by the string after it, which the reference renders)."""
    if not (inspect.isclass(obj) or inspect.isfunction(obj)) or getattr(obj, "__module__", "") == "typing":
        return []
    doc = inspect.getdoc(obj) or ""
    if not doc.strip():
        return ["no docstring"]
    problems = []
    summary = doc.split("\n\n", 1)[0]
    if "\n" in summary or len(summary) > 120 or not summary.rstrip().endswith("."):
        problems.append("the first paragraph is not a one-line summary ending with a period")
    if inspect.isclass(obj) and issubclass(obj, (BaseException, enum.Enum)):
        return problems
    plain_data = inspect.isclass(obj) and (dataclasses.is_dataclass(obj) or hasattr(obj, "_fields"))
    try:  # a class's signature is its constructor's (pydantic models: their fields)
        params = [p for p in inspect.signature(obj).parameters.values() if p.name not in ("self", "cls")
                  and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    if params and "Args:" not in doc and "Attributes:" not in doc:
        problems.append("no Args: section")
    if inspect.isfunction(obj):
        returns = inspect.signature(obj).return_annotation
        if returns not in (None, "None", inspect.Signature.empty) and "Returns:" not in doc:
            problems.append("no Returns: section")
    if (inspect.isfunction(obj) or (params and not plain_data)) and "Raises:" not in doc:
        problems.append("no Raises: section")
    return problems


def test_every_public_name_documents_itself():
    problems = [f"{m}.{n}: {p}" for m, n, obj in public_names() for p in doc_problems(obj)]
    assert not problems, "\n".join(problems)


# Every other public name of the package needs a docstring too: a one-line summary is enough where the signature
# says the rest.


def package_modules() -> list[str]:
    """Every module of reshard/ by dotted name, reshard.testing excepted."""
    names = []
    for path in sorted((ROOT / "reshard").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[:2] != ("reshard", "testing"):
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def undocumented(module) -> list[str]:
    """The public functions and classes defined in `module`, and their own public methods and properties, that have
    no docstring (an override documented where it is first declared counts as documented)."""
    missing = []
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__ \
                or not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if not (inspect.getdoc(obj) or "").strip():
            missing.append(name)
        for attr, member in vars(obj).items() if inspect.isclass(obj) else ():
            function = getattr(member, "__func__", None) or getattr(member, "fget", None) \
                or getattr(member, "func", None) if isinstance(member, (staticmethod, classmethod, property,
                                                                        functools.cached_property)) else member
            if not attr.startswith("_") and inspect.isfunction(function) \
                    and function.__qualname__ == f"{obj.__qualname__}.{function.__name__}" \
                    and not (inspect.getdoc(getattr(obj, attr, function)) or inspect.getdoc(function) or "").strip():
                missing.append(f"{name}.{attr}")
    return missing


def imported(module_name: str):
    """The module, or a skip where it needs a framework this environment lacks (checked where it is installed)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and not e.name.startswith("reshard"):
            pytest.skip(f"{module_name} needs {e.name}")
        raise


@pytest.mark.parametrize("module_name", package_modules())
def test_every_public_name_has_a_docstring(module_name):
    missing = undocumented(imported(module_name))
    assert not missing, f"{module_name}: no docstring: {', '.join(missing)}"


def test_readme_is_a_front_door():
    """One screen-ish: the two commands first (set-up + main job, set-up + tests), then where to go."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    first = re.search(r"^```bash\n(.*?)^```", text, re.S | re.M).group(1).strip().splitlines()
    assert [line.split()[:2] for line in first] == [["scripts/reshard", "plan"], ["scripts/test"]]
    assert text.index("```bash") < text.index("## ")
