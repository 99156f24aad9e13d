"""docs/testing.md's test map names every test file and helper script under tests/, and
every marker the tests use is registered (pyproject.toml, --strict-markers)."""
from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.abspath(__file__))
while not os.path.exists(os.path.join(ROOT, "pyproject.toml")):  # tests/ or a folder below it
    ROOT = os.path.dirname(ROOT)


def _test_files() -> list[str]:
    out = []
    for dirpath, dirs, files in os.walk(os.path.join(ROOT, "tests")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        out += [f for f in files if f.endswith(".py") and f not in ("conftest.py", "__init__.py")]
    return sorted(out)


def _mapped(text: str) -> set[str]:
    return set(re.findall(r"^\| `([\w.]+\.py)` \|", text, re.M))


def test_every_test_file_is_in_the_test_map():
    doc = open(os.path.join(ROOT, "docs", "testing.md")).read()
    missing = sorted(set(_test_files()) - _mapped(doc))
    assert not missing, f"add these to the test map in docs/testing.md: {missing}"


def test_the_architecture_doc_links_the_test_map():
    assert "testing.md" in open(os.path.join(ROOT, "docs", "architecture.md")).read()


def test_every_marker_the_tests_use_is_registered():
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        ini = tomllib.load(f)["tool"]["pytest"]["ini_options"]
    registered = {m.split(":")[0].strip() for m in ini["markers"]}
    assert {"slow", "distributed", "cuda"} <= registered
    assert "--strict-markers" in ini["addopts"]


def test_files_that_start_rank_processes_mark_them_distributed():
    """A test file that launches ranks (runtime.launch, the program fuzzer's run_sp) says so
    with the distributed marker, so `-m "not distributed"` leaves it out."""
    unmarked = []
    for dirpath, dirs, files in os.walk(os.path.join(ROOT, "tests")):
        for f in files:
            if f.startswith("test_") and f.endswith(".py"):
                src = open(os.path.join(dirpath, f)).read()
                if re.search(r"\b(start_local_ranks|run_local_ranks|run_sp)\(", src) and \
                        "pytest.mark.distributed" not in src:
                    unmarked.append(f)
    assert not unmarked, f"mark the tests that start ranks with @pytest.mark.distributed in: {sorted(unmarked)}"
