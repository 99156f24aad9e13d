"""`sppo_fx/codegen/split_compile.py`: a forked child compiles the backward graph into
Inductor's cache while this process compiles the forward graph; whatever goes wrong in the
child, this process compiles the backward graph itself."""
from __future__ import annotations

import os
import time

import pytest
import torch

import sppo_fx
from sppo_fx.codegen import split_compile
from sppo_fx.codegen.split_compile import BackwardInChild
from sppo_fx.models import build

from conftest import assert_matches_eager, needs_fork


def _cache_hits():
    from torch._dynamo.utils import counters
    return counters["inductor"]


def _compile_into(marker):
    """A stand-in for Inductor's backward compile: the child writes the "cache entry" (its
    pid), this process counts a cache hit when it finds one."""
    def compile_fn():
        if os.path.exists(marker):
            _cache_hits()["fxgraph_cache_hit"] += 1
            return "hit"
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        return "compiled"
    return compile_fn


@needs_fork
def test_the_child_compiles_and_this_process_finds_it(tmp_path):
    marker = tmp_path / "entry"
    split = BackwardInChild("test")
    split.fork()
    out = split.compile_backward(_compile_into(marker))  # the child exits in there
    split.leave()
    assert out == "hit" and split.from_child
    assert int(marker.read_text()) not in (os.getpid(), 0)  # written by the child


@needs_fork
def test_a_child_that_fails_leaves_the_compile_here(tmp_path):
    here = os.getpid()
    marker = tmp_path / "entry"

    def compile_fn():
        if os.getpid() != here:
            raise RuntimeError("only in the child")
        return _compile_into(marker)()

    split = BackwardInChild("test")
    split.fork()
    assert split.compile_backward(compile_fn) == "compiled"
    split.leave()
    assert not split.from_child and int(marker.read_text()) == here


@needs_fork
def test_a_child_that_hangs_is_killed_and_the_compile_done_here(tmp_path, monkeypatch):
    monkeypatch.setattr(split_compile, "MIN_WAIT_S", 0.5)
    monkeypatch.setattr(split_compile, "WAIT_FACTOR", 0.0)
    here = os.getpid()
    marker = tmp_path / "entry"

    def compile_fn():
        if os.getpid() != here:
            time.sleep(60)
        return _compile_into(marker)()

    split = BackwardInChild("test")
    split.fork()
    child = split.child.pid
    t0 = time.monotonic()
    assert split.compile_backward(compile_fn) == "compiled"
    assert time.monotonic() - t0 < 30 and not split.from_child
    split.leave()
    with pytest.raises(ChildProcessError):  # reaped: no zombie left behind
        os.waitpid(child, os.WNOHANG)


@needs_fork
def test_a_child_never_returns_past_the_compile(tmp_path):
    """A child that leaves the compile without reaching the backward graph (an error; a
    backward compiled lazily) exits at `leave`: nothing after it runs twice."""
    after = tmp_path / "after"
    split = BackwardInChild("test")
    split.fork()
    child = split.child.pid
    split.leave()
    with open(after, "a") as f:
        f.write(f"{os.getpid()}\n")
    assert after.read_text().split() == [str(os.getpid())]
    with pytest.raises(ChildProcessError):
        os.waitpid(child, os.WNOHANG)


def test_no_fork_when_forking_is_off(monkeypatch):
    monkeypatch.setenv("SPPO_FX_FORK", "off")
    assert not split_compile.eligible([torch.zeros(2)])


@needs_fork
def test_a_compiled_program_takes_its_backward_graph_from_the_child():
    """End to end, on a cold Inductor cache: this process compiles the forward graph only
    (one cache miss), finds the backward graph the child compiled (one hit), and the step
    equals eager's."""
    from torch._inductor.utils import fresh_cache
    model = build("llama")
    x, y = torch.randint(0, 97, (2, 40)), torch.randint(0, 97, (2, 40))
    with fresh_cache():
        before = dict(_cache_hits())
        compiled = sppo_fx.compile(model, chunks=4)
        assert_matches_eager(model, lambda m: m(x, y), lambda: compiled(x, y))
        after = _cache_hits()
    assert compiled.codegen.stats.backward_in_child == 1
    assert after["fxgraph_cache_miss"] - before.get("fxgraph_cache_miss", 0) == 1
    assert after["fxgraph_cache_hit"] - before.get("fxgraph_cache_hit", 0) == 1
