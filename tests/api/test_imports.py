"""Every module of sppo_fx imports on its own, and no two modules import each other.

Two checks (docs/architecture.md, section 5 "Package layout and dependency order"):

* static: the import graph of sppo_fx, read from the source (module-level and
  function-level imports alike: a function-level import is still a dependency), has no
  cycle between modules and none between sub-packages (e.g. runtime <-> solver);
* dynamic: each module is imported first, in a fresh process in which no other module
  outside `import sppo_fx`'s own chain has been imported yet, so an import error or a
  cycle that breaks depending on which module is imported first shows up. Importing any
  `sppo_fx.x` runs `sppo_fx/__init__.py` (and everything it imports, always in the same
  order) before `x`; so one helper process imports the third-party packages and `sppo_fx`
  once, then forks a child per module that this did not load, which is the state a fresh
  interpreter would reach at `import sppo_fx.x`, and keeps this test to seconds.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from collections import defaultdict

import pytest

import sppo_fx

PACKAGE_DIR = os.path.dirname(os.path.abspath(sppo_fx.__file__))
ROOT = os.path.dirname(PACKAGE_DIR)
# Running it executes the CLI; `python -m sppo_fx` is what tests/api/test_cli.py covers.
NOT_IMPORTABLE = {"sppo_fx.__main__"}


def _modules() -> dict[str, str]:
    """Module name -> file, for every .py file of the package."""
    out = {}
    for dirpath, _, files in os.walk(PACKAGE_DIR):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path[:-3], ROOT).replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def _import_graph(mods: dict[str, str]) -> dict[str, set[str]]:
    """module -> the sppo_fx modules it imports (the deepest module each import names)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        is_pkg = path.endswith("__init__.py")
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = name.split(".") if is_pkg else name.split(".")[:-1]
                    parts = parts[: len(parts) - (node.level - 1)]
                    stem = ".".join(parts + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                targets = [stem] + [f"{stem}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                # an import of an enclosing package is not a cycle: Python runs it first
                if t and t != name and t.startswith("sppo_fx.") and not name.startswith(t + "."):
                    graph[name].add(t)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (iterative Tarjan)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in list(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_cycle_between_modules():
    cycles = _cycles(_import_graph(_modules()))
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_import_cycle_between_subpackages():
    graph = _import_graph(_modules())
    sub: dict[str, set[str]] = defaultdict(set)
    for a, targets in graph.items():
        for b in targets:
            if "." not in a or "." not in b:  # the package's own __init__
                continue
            pa, pb = a.split(".")[1], b.split(".")[1]
            if pa != pb:
                sub[pa].add(pb)
    cycles = sorted({tuple(sorted((a, b))) for a in sub for b in sub[a] if a in sub.get(b, ())})
    examples = {(a, b): sorted((x, y) for x in graph for y in graph[x]
                               if "." in x and "." in y and {x.split(".")[1], y.split(".")[1]} == {a, b})[:4] for a, b in cycles}
    assert not cycles, f"sub-package cycles (with the imports that form them): {examples}"


def test_the_cycle_check_finds_a_cycle():
    # the check itself: a two-module cycle and a three-module one are found, a chain is not
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


_FORK_IMPORTS = textwrap.dedent("""
    import importlib, os, sys, traceback
    import torch, sympy, tabulate  # third-party packages, imported once
    try:
        import triton  # noqa: F401
    except Exception:
        pass
    assert not [m for m in sys.modules if m == "sppo_fx" or m.startswith("sppo_fx.")]
    import sppo_fx  # what every `import sppo_fx.x` runs first, in this order
    loaded = {m for m in sys.modules if m.startswith("sppo_fx.")}
    failed = []
    for name in sys.argv[1:]:
        if name in loaded:
            continue
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                importlib.import_module(name)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            failed.append(name)
    print("loaded by sppo_fx:", len(loaded), "imported first in a child:", len(set(sys.argv[1:]) - loaded))
    print("FAILED:", " ".join(failed) if failed else "none")
    sys.exit(1 if failed else 0)
""")


@pytest.mark.slow
def test_every_module_imports_first_in_a_fresh_process():
    names = sorted(set(_modules()) - NOT_IMPORTABLE)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _FORK_IMPORTS, *names], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    assert "FAILED: none" in proc.stdout
