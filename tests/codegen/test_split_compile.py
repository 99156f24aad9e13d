"""`sppo_fx/codegen/split_compile.py`: a forked child compiles the backward graph into
Inductor's cache while this process compiles the forward graph; whatever goes wrong in the
child, this process compiles the backward graph itself, and the child never returns into
the caller's code."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.fx as fx

import sppo_fx
from sppo_fx.codegen import split_compile
from sppo_fx.codegen.split_compile import BackwardInChild
from sppo_fx.models import build

from conftest import assert_matches_eager, needs_fork


@pytest.fixture(autouse=True)
def _a_free_core(monkeypatch):
    """The fork waits for a free core; these tests share the machine with the suite's other
    worker, and test what happens once it forks."""
    monkeypatch.setattr(split_compile, "a_core_is_free", lambda: True)


def _counters():
    from torch._dynamo.utils import counters
    return counters["inductor"]


def _compile_into(marker):
    """A stand-in for Inductor's backward compile: the child writes the "cache entry" (its
    pid), this process counts a cache hit when it finds one."""
    def compile_fn():
        if os.path.exists(marker):
            _counters()["fxgraph_cache_hit"] += 1
            return "hit"
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        return "compiled"
    return compile_fn


def _exit_if_child(here):
    if os.getpid() != here:  # a child that got past the code under test: end it, loudly
        os._exit(99)


@needs_fork
def test_the_child_compiles_and_this_process_finds_it(tmp_path):
    here, marker = os.getpid(), tmp_path / "entry"
    split = BackwardInChild("test")
    try:
        split.fork()
        child = split.child.pid  # None in the child, which exits in compile_backward
        out = split.compile_backward(_compile_into(marker))
    finally:
        split.leave()
        _exit_if_child(here)
    assert child is not None and out == "hit" and split.from_child
    assert int(marker.read_text()) not in (here, 0)  # written by the child


@needs_fork
def test_a_child_that_fails_leaves_the_compile_here(tmp_path):
    here, marker = os.getpid(), tmp_path / "entry"

    def compile_fn():
        if os.getpid() != here:
            raise RuntimeError("only in the child")
        return _compile_into(marker)()

    split = BackwardInChild("test")
    try:
        split.fork()
        child = split.child.pid
        out = split.compile_backward(compile_fn)
    finally:
        split.leave()
        _exit_if_child(here)
    assert child is not None
    assert out == "compiled" and not split.from_child and int(marker.read_text()) == here
    assert split.child.exit_status == 1


@needs_fork
def test_a_child_past_its_time_is_left_to_finish_and_the_compile_done_here(tmp_path, monkeypatch):
    """Not killed: its C++ compiles write kernel libraries in place (module docstring)."""
    monkeypatch.setattr(split_compile, "MIN_WAIT_S", 0.5)
    monkeypatch.setattr(split_compile, "WAIT_FACTOR", 0.0)
    here, marker, finished = os.getpid(), tmp_path / "entry", tmp_path / "finished"

    def compile_fn():
        if os.getpid() != here:
            time.sleep(3)
            finished.write_text("yes")
            return "late"
        return _compile_into(marker)()

    split = BackwardInChild("test")
    try:
        split.fork()
        child = split.child.pid
        t0 = time.monotonic()
        out = split.compile_backward(compile_fn)
        waited = time.monotonic() - t0
    finally:
        split.leave()
        _exit_if_child(here)
    assert child is not None
    assert out == "compiled" and not split.from_child and waited < 3
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (finished.exists() and finished.read_text() == "yes"):
        time.sleep(0.1)  # (the file exists, empty, a moment before it is written)
    assert finished.read_text() == "yes"  # it ran to its end
    while time.monotonic() < deadline:  # and was reaped in the background: no zombie
        try:
            os.waitpid(child, os.WNOHANG)
        except ChildProcessError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the child was not reaped")


@needs_fork
def test_a_child_never_returns_past_the_compile():
    """A child that leaves the compile without reaching the backward graph (an error; a
    backward compiled lazily) exits at `leave` with status 1."""
    here = os.getpid()
    split = BackwardInChild("test")
    split.fork()
    if split.in_child:
        split.leave()
        os._exit(99)  # not reached: the test below would see 99
    assert split.child.pid is not None
    payload, _ = split.child.receive(30)
    assert payload == b"the child left the compile" and split.child.exit_status == 1
    assert os.getpid() == here


def _graph_with_input(val) -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = val
    g.output((x,))
    return fx.GraphModule(torch.nn.Module(), g)


@needs_fork
def test_no_fork_for_a_backward_graph_compiled_lazily():
    """Without a symbolic size from the forward graph, AOTAutograd compiles the backward
    graph at the first backward, after this compile: a child would compile nothing."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    here = os.getpid()
    split = BackwardInChild("test")
    split.fork(_graph_with_input(torch.empty(2)))
    assert split.forked and split.child.pid is None and os.getpid() == here
    size = ShapeEnv().create_unbacked_symint()
    split = BackwardInChild("test")
    try:
        split.fork(_graph_with_input(size))
        child = split.child.pid  # None in the child, which exits in leave()
    finally:
        split.leave()
        _exit_if_child(here)
    assert child is not None


def test_no_fork_when_forking_is_off(monkeypatch):
    monkeypatch.setenv("SPPO_FX_FORK", "off")
    assert not split_compile.eligible([torch.zeros(2)])


def test_no_fork_without_a_free_core(monkeypatch):
    monkeypatch.setattr(split_compile, "a_core_is_free", lambda: False)
    split = BackwardInChild("test")
    split.fork()
    assert split.forked and split.child.pid is None and not split.in_child


@pytest.mark.slow
@needs_fork
def test_a_compiled_program_takes_its_backward_graph_from_the_child(monkeypatch):
    """End to end, on a cold Inductor cache: this process compiles the forward graph only
    (one cache miss), finds the backward graph the child compiled (one hit), and the step
    equals eager's."""
    from torch._inductor.utils import fresh_cache
    from sppo_fx.codegen import inductor
    # on a loaded machine the child may be slow: this test checks where the graph is
    # compiled, not how long the parent waits
    monkeypatch.setattr(split_compile, "MIN_WAIT_S", 900.0)
    join = inductor._join_cpu_probe
    monkeypatch.setattr(inductor, "_join_cpu_probe", lambda timeout_s=60.0: join(None))
    model = build("llama", n_layers=1)  # where the graphs compile, not how deep the model is
    x, y = torch.randint(0, 97, (2, 40)), torch.randint(0, 97, (2, 40))
    with fresh_cache():
        before = dict(_counters())
        compiled = sppo_fx.compile(model, chunks=4)
        assert_matches_eager(model, lambda m: m(x, y), lambda: compiled(x, y))
        after = _counters()
    assert compiled.codegen.stats.backward_in_child == 1
    assert after["fxgraph_cache_miss"] - before.get("fxgraph_cache_miss", 0) == 1
    assert after["fxgraph_cache_hit"] - before.get("fxgraph_cache_hit", 0) == 1
