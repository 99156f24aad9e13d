"""Run CPU-bound Python work in a forked child while this process does other work.

Tracing or compiling a chunk program is Python work that holds the GIL: two such jobs in one
process take the sum of their times, whatever the core count. A forked child starts with
this process's memory (the captured program, its parameters, every imported module, the
caller's whole stack) at the cost of a page-table copy, so it can take one job while this
process does the other.

Two shapes of it:

- `ForkedCall`: the child computes `fn()` and sends back its pickled value.

      with ForkedCall(fn, "the first chunk's memory model") as call:
          mine = other_work()
          theirs = call.result()        # fn()'s value, computed in the child

  `result()` computes `fn()` here instead (and says why, at debug level) when no child was
  forked, or when the child failed, died, or sent nothing within the timeout: a child can
  only ever make the call faster, never change what it returns.
- `ForkedChild`: the plumbing under it, for a child that carries on from the fork point in
  the caller's own stack and ends with `exit_with` (`sppo_fx/codegen/split_compile.py`: the
  child compiles the backward graph into Inductor's on-disk cache while this process
  compiles the forward graph).

A child is forked only on Linux, with more than one CPU, and when `SPPO_FX_FORK=off` is not
set. Callers fork only for work on CPU tensors: a child of a process that has initialised
CUDA cannot use it.
"""
from __future__ import annotations

import os
import pickle
import select
import signal
import sys
import time
import warnings
from typing import Callable, NoReturn

from sppo_fx.disk_cache import enabled
from sppo_fx.log import get_logger

log = get_logger(__name__)
ENV = "SPPO_FX_FORK"


def can_fork() -> bool:
    """Whether `ForkedCall` forks: Linux, more than one usable CPU, `SPPO_FX_FORK` not off."""
    if not sys.platform.startswith("linux") or not enabled(ENV):
        return False
    try:
        return len(os.sched_getaffinity(0)) > 1
    except OSError:  # pragma: no cover - affinity unknown
        return (os.cpu_count() or 1) > 1


class ForkedChild:
    """A forked child process with a pipe back to this one.

    `fork()` returns True in both processes when a child was forked (`in_child` says which
    one this is) and False when none was (no pipe, no fork: the caller does the work itself).
    The child ends with `exit_with(payload)`, never by returning past its caller's frames;
    this process reads the payload with `receive(timeout)` and reaps the child with `stop()`
    (which kills it if it still runs).

    Args:
        what: a label for debug messages.
    """

    def __init__(self, what: str):
        self.what = what
        self.pid: int | None = None
        self.fd: int | None = None
        self.in_child = False
        self.started = time.perf_counter()

    def fork(self) -> bool:
        try:
            r, w = os.pipe()
        except OSError as e:  # out of descriptors: the caller does it here
            log.debug("%s: no pipe (%s); computing it here", self.what, e)
            return False
        try:
            with warnings.catch_warnings():
                # Python >= 3.12 warns that a multi-threaded process forks: this code's threads
                # (progress lines, the store's copies) hold no lock the child needs
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
        except OSError as e:  # no memory or process slots for a child: the caller does it here
            os.close(r)
            os.close(w)
            log.debug("%s: no fork (%s); computing it here", self.what, e)
            return False
        self.started = time.perf_counter()
        if pid == 0:
            os.close(r)
            self.in_child, self.fd = True, w
            _quiet_child()
        else:
            os.close(w)
            self.pid, self.fd = pid, r
        return True

    def exit_with(self, payload: bytes, code: int = 0) -> NoReturn:
        """In the child: send `payload` and exit (no atexit handlers, no buffered output of
        the parent's flushed twice)."""
        try:
            with os.fdopen(self.fd, "wb") as f:
                f.write(payload)
        finally:
            os._exit(code)

    def receive(self, timeout: float | None) -> tuple[bytes | None, str]:
        """In this process: the child's payload (None if there is none) and why there is
        none; the child is reaped either way."""
        try:
            payload = _read_all(self.fd, timeout)
            why = "sent nothing in time" if payload is None else ""
        except OSError as e:
            payload, why = None, f"could not be read ({e})"
        finally:
            self.stop()
        return payload, why

    def stop(self) -> None:
        """Close the pipe and reap the child (killed if it still runs)."""
        if self.fd is not None and not self.in_child:
            os.close(self.fd)
            self.fd = None
        if self.pid is not None:
            pid, self.pid = self.pid, None
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
                if done == 0:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
            except ChildProcessError:  # pragma: no cover - reaped elsewhere
                pass


def _quiet_child() -> None:
    import logging
    logging.disable(logging.CRITICAL)  # the parent reports the phase; the child says nothing
    import torch
    # the parent keeps its cores; and OpenMP's threads did not survive the fork (a parallel
    # region in the child would wait for them forever)
    torch.set_num_threads(1)


class ForkedCall:
    """`fn()` computed in a forked child (see the module docstring).

    Args:
        fn: the computation; its result must pickle. It runs in the child with one
            intra-op thread and logging off (the parent reports).
        what: a label for debug messages.
        fork: False computes `fn()` in `result()`, in this process.
    """

    def __init__(self, fn: Callable[[], object], what: str, fork: bool = True):
        self.fn, self.what = fn, what
        self.child = ForkedChild(what)
        if fork and can_fork() and self.child.fork() and self.child.in_child:
            _run_child(fn, self.child)  # never returns

    @property
    def pid(self) -> int | None:
        return self.child.pid

    def __enter__(self) -> "ForkedCall":
        return self

    def __exit__(self, *exc) -> None:
        self.child.stop()

    def result(self, timeout: float | None = None):
        """`fn()`'s value: the child's, or computed here if the child has none (`timeout`
        seconds from now at most; None waits as long as the child runs)."""
        if self.child.pid is None:
            return self.fn()
        payload, why = self.child.receive(timeout)
        if payload is not None:
            try:
                status, value = pickle.loads(payload)
            except Exception as e:  # noqa: BLE001 - a truncated message: the child died writing
                status, value = "error", f"{type(e).__name__}: {e}"
            if status == "ok":
                log.debug("%s: computed in a forked child (%.1f s)", self.what,
                          time.perf_counter() - self.child.started)
                return value
            why = f"failed: {value}"
        log.debug("%s: the forked child %s; computing it here", self.what, why)
        return self.fn()


def _run_child(fn, child: ForkedChild) -> NoReturn:
    code = 0
    try:
        payload = pickle.dumps(("ok", fn()))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which computes it itself
        payload = pickle.dumps(("error", f"{type(e).__name__}: {e}"))
        code = 1
    child.exit_with(payload, code)


def _read_all(fd: int, timeout: float | None) -> bytes | None:
    """Everything written to `fd` until its writer closes it; None if `timeout` passes first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    poller = select.poll()  # not select.select: it refuses descriptors >= 1024
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    chunks = []
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return None
        if not poller.poll(None if left is None else max(1, int(left * 1000))):
            return None
        data = os.read(fd, 1 << 20)
        if not data:
            return b"".join(chunks)
        chunks.append(data)
