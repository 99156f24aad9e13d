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
import threading
import time
import warnings
from typing import Callable, NoReturn

from sppo_fx.util.disk_cache import enabled
from sppo_fx.util.log import get_logger

log = get_logger(__name__)
ENV = "SPPO_FX_FORK"
# a child that has closed its pipe is in `os._exit`; tearing down a large address space
# on a busy machine takes a moment, and a kill meanwhile would hide its exit status
EXIT_GRACE_S = 5.0
LOADAVG = "/proc/loadavg"  # "0.52 0.61 0.70 3/412 12345": the 4th field is runnable/all threads


def can_fork() -> bool:
    """Whether `ForkedCall` and `ForkedChild`'s users fork: Linux, more than one usable CPU,
    `SPPO_FX_FORK` not off."""
    if not sys.platform.startswith("linux") or not enabled(ENV):
        return False
    return usable_cpus() > 1


def others_runnable(samples: int = 10, interval_s: float = 0.01) -> float | None:
    """Threads of other processes (or other threads of this one) that want a core now: the
    kernel's count of runnable threads (`/proc/loadavg`'s fourth field) less the caller,
    averaged over `samples` readings; None where the OS does not report it. Unlike the
    1-minute load average, it leaves out this process's own work of the last minute (a
    first call traces its memory model in two processes just before it calibrates)."""
    counts = []
    for k in range(samples):
        try:
            with open(LOADAVG) as f:
                counts.append(int(f.read().split()[3].split("/")[0]) - 1)
        except (OSError, ValueError, IndexError):
            return None
        if k + 1 < samples:
            time.sleep(interval_s)
    return max(0.0, sum(counts) / len(counts))


def a_core_is_free() -> bool:
    """Whether a forked child would have a core of its own: on average at most the usable
    cores less two (this process's and the child's) other runnable threads. On a machine
    whose cores are taken (a test suite's workers, other jobs) a child only adds overheads."""
    others = others_runnable(samples=5)
    return others is None or others < usable_cpus() - 1.5


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (OSError, AttributeError):  # pragma: no cover - affinity unknown
        return os.cpu_count() or 1


class ForkedChild:
    """A forked child process with a pipe back to this one.

    `fork()` returns True in both processes when a child was forked (`in_child` says which
    one this is) and False when none was (no pipe, no fork: the caller does the work itself).
    The child ends with `exit_with(payload)`, never by returning past its caller's frames;
    this process reads the payload with `receive(timeout)` and reaps the child with `stop()`
    (which kills it if it still runs) or `detach()` (which lets it finish and reaps it in the
    background: for a child whose own subprocesses write files that a kill would leave
    half-written). `exit_status` is the child's exit code once it is reaped here.

    Args:
        what: a label for debug messages.
    """

    def __init__(self, what: str):
        self.what = what
        self.pid: int | None = None
        self.fd: int | None = None
        self.in_child = False
        self.exit_status: int | None = None
        self.started = time.perf_counter()

    def fork(self) -> bool:
        try:
            r, w = os.pipe()
        except OSError as e:  # out of descriptors: the caller does it here
            log.debug("%s: no pipe (%s); computing it here", self.what, e)
            return False
        try:
            with warnings.catch_warnings():
                # Python >= 3.12 warns that a multi-threaded process forks: a lock another
                # thread (progress lines, the store's copies) held at the fork stays held in
                # the child; the caller's timeout is what bounds a child stuck on one
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
        except OSError as e:  # no memory or process slots for a child: the caller does it here
            os.close(r)
            os.close(w)
            log.debug("%s: no fork (%s); computing it here", self.what, e)
            return False
        self.started = time.perf_counter()
        if pid == 0:
            try:
                os.close(r)
                self.in_child, self.fd = True, w
                _quiet_child()
            except BaseException:  # noqa: BLE001 - the child must never return into the caller
                os._exit(1)
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

    def receive(self, timeout: float | None, kill: bool = True) -> tuple[bytes | None, str]:
        """In this process: the child's payload (None if there is none) and why there is
        none. Then the child is reaped: `stop()`, or `detach()` when not `kill`."""
        try:
            payload = _read_all(self.fd, timeout)
            why = "sent nothing in time" if payload is None else ""
        except OSError as e:
            payload, why = None, f"could not be read ({e})"
        finally:
            if payload is not None:  # a child that sent everything is exiting: let it
                self.stop(grace_s=EXIT_GRACE_S)
            elif kill:
                self.stop()
            else:
                self.detach()
        if payload == b"" and self.exit_status is not None:
            why = f"exited with status {self.exit_status} and sent nothing"
        return payload, why

    def stop(self, grace_s: float = 0.0) -> None:
        """Close the pipe and reap the child: killed if it still runs `grace_s` seconds
        from now."""
        self._close()
        if self.pid is not None:
            pid, self.pid = self.pid, None
            try:
                deadline = time.perf_counter() + grace_s
                done, status = os.waitpid(pid, os.WNOHANG)
                while done == 0 and time.perf_counter() < deadline:
                    time.sleep(0.005)
                    done, status = os.waitpid(pid, os.WNOHANG)
                if done == 0:
                    os.kill(pid, signal.SIGKILL)
                    _, status = os.waitpid(pid, 0)
                self.exit_status = os.waitstatus_to_exitcode(status)
            except ChildProcessError:  # pragma: no cover - reaped elsewhere
                pass

    def detach(self) -> None:
        """Close the pipe and let the child run to its end; a daemon thread reaps it (a
        child still running when this process exits is left to finish alone)."""
        self._close()
        if self.pid is not None:
            pid, self.pid = self.pid, None
            threading.Thread(target=_reap, args=(pid,), daemon=True, name="sppo_fx-reap-child").start()

    def _close(self) -> None:
        if self.fd is not None and not self.in_child:
            os.close(self.fd)
            self.fd = None


def _reap(pid: int) -> None:
    try:
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
    payload, code = b"", 1
    try:
        payload, code = pickle.dumps(("ok", fn())), 0
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which computes it itself
        try:
            payload = pickle.dumps(("error", f"{type(e).__name__}: {e}"))
        except BaseException:  # noqa: BLE001 - an exception that cannot be described
            pass
    finally:
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
