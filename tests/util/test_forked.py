"""`sppo_fx/util/forked.py`: a computation run in a forked child comes back from the child, and
whatever goes wrong there (an error, a hang, no fork) it is computed in this process instead."""
from __future__ import annotations

import os
import time

import pytest

from sppo_fx.util.forked import ForkedCall, ForkedChild, can_fork

from conftest import needs_fork


@needs_fork
def test_the_value_is_computed_in_another_process():
    here = os.getpid()
    with ForkedCall(lambda: (os.getpid(), [1, 2, 3] * 1000), "pid") as call:
        pid, data = call.result(timeout=60)
    assert pid != here and data == [1, 2, 3] * 1000


@needs_fork
def test_a_child_that_fails_is_computed_here():
    here = os.getpid()

    def fn():
        if os.getpid() != here:
            raise RuntimeError("only in the child")
        return "here"

    with ForkedCall(fn, "fails in the child") as call:
        assert call.result(timeout=60) == "here"


@needs_fork
def test_a_child_that_hangs_is_killed_and_computed_here():
    here = os.getpid()

    def fn():
        if os.getpid() != here:
            time.sleep(60)
        return "here"

    t0 = time.monotonic()
    with ForkedCall(fn, "hangs in the child") as call:
        child = call.pid
        assert call.result(timeout=0.5) == "here"
    assert time.monotonic() - t0 < 30
    with pytest.raises(ChildProcessError):  # reaped: no zombie left behind
        os.waitpid(child, os.WNOHANG)


def test_without_fork_it_is_computed_here(monkeypatch):
    monkeypatch.setenv("SPPO_FX_FORK", "off")
    assert not can_fork()
    call = ForkedCall(os.getpid, "off")
    assert call.pid is None and call.result() == os.getpid()


@needs_fork
def test_leaving_the_block_early_kills_the_child():
    here = os.getpid()
    with pytest.raises(KeyboardInterrupt):
        with ForkedCall(lambda: time.sleep(60) if os.getpid() != here else None, "interrupted") as call:
            child = call.pid
            raise KeyboardInterrupt
    with pytest.raises(ChildProcessError):
        os.waitpid(child, os.WNOHANG)


@needs_fork
def test_the_child_logs_nothing(capfd):
    """The parent reports the work (its progress lines); the child's own log messages would
    print twice (its stderr is the parent's)."""
    import logging
    import sys
    here = os.getpid()
    log = logging.getLogger("sppo_fx.passes.cost.saved_cache")
    handler = logging.StreamHandler(sys.stderr)
    log.addHandler(handler)

    def fn():
        log.warning("said by %s", "the child" if os.getpid() != here else "this process")
        return 1

    try:
        with ForkedCall(fn, "logs") as call:
            assert call.result(timeout=60) == 1
    finally:
        log.removeHandler(handler)
    assert "said by the child" not in capfd.readouterr().err


@needs_fork
def test_a_fork_that_fails_is_computed_here(monkeypatch):
    """No memory or process slot for a child (ENOMEM, EAGAIN): no error, no open pipe."""
    def no_fork():
        raise OSError(12, "Cannot allocate memory")
    pipes = []
    real_pipe = os.pipe

    def pipe():
        pipes.extend(real_pipe())
        return pipes[-2], pipes[-1]
    monkeypatch.setattr(os, "fork", no_fork)
    monkeypatch.setattr(os, "pipe", pipe)
    call = ForkedCall(os.getpid, "no fork")
    assert call.pid is None and call.result() == os.getpid()
    assert len(pipes) == 2
    for fd in pipes:  # (only these: other threads may open and close files meanwhile)
        with pytest.raises(OSError):
            os.fstat(fd)


def test_a_core_is_free_only_when_the_others_leave_one(monkeypatch):
    """A child needs a core of its own: with N usable cores, at most N - 2 other runnable
    threads on average."""
    from sppo_fx.util import forked
    monkeypatch.setattr(forked, "usable_cpus", lambda: 4)
    for others, free in ((0.0, True), (2.0, True), (2.6, False), (7.0, False), (None, True)):
        monkeypatch.setattr(forked, "others_runnable", lambda samples=10, others=others: others)
        assert forked.a_core_is_free() is free, others


def test_others_runnable_reads_the_kernels_count_less_the_caller(tmp_path, monkeypatch):
    from sppo_fx.util import forked
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("0.52 0.61 0.70 3/412 12345\n")
    monkeypatch.setattr(forked, "LOADAVG", str(loadavg))
    assert forked.others_runnable(samples=2, interval_s=0) == 2.0
    loadavg.write_text("not a loadavg\n")
    assert forked.others_runnable(samples=2, interval_s=0) is None


@needs_fork
def test_a_child_that_sent_everything_is_let_exit_not_killed():
    """A child is slow to exit after its pipe closes (a large address space to tear down on a
    busy machine): `receive` reaps it with its own exit status, not a kill's."""
    child = ForkedChild("test")
    assert child.fork()
    if child.in_child:
        try:
            os.write(child.fd, b"done")
            os.close(child.fd)
            time.sleep(0.5)
        finally:
            os._exit(3)
    payload, why = child.receive(30)
    assert payload == b"done" and why == ""
    assert child.exit_status == 3
