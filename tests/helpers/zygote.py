"""Rank processes forked from a "zygote" that has already imported torch, sppo_fx and
transformers, instead of fresh interpreters that import them again (2.5-5 CPU-s a rank).

tests/conftest.py's `start_rank` (the process starter of
`sppo_fx.runtime.launch.start_local_ranks`) calls it unless SPPO_TEST_FORK_RANKS=0.
`start_process(cmd, env=..., **popen_kwargs)` forks the rank from a zygote
(tests/helpers/zygote_server.py; one per pytest process and import-time environment,
started on first use) when it can give the rank what
`subprocess.Popen(cmd, env=env, ...)` would, and calls `subprocess.Popen` otherwise:

- `cmd` is `[sys.executable, script, ...]` with an existing script file (not `-m`, `-c`,
  interpreter options, `env ...` or torchrun);
- only stdin None or DEVNULL, stdout/stderr None, PIPE, DEVNULL, STDOUT or a descriptor,
  text/encoding/errors, cwd, env and bufsize are given;
- the environment differs from the zygote's only in variables read when used, never when a
  module is imported (`SAFE_VARS`): any other difference (PYTHONHASHSEED, MALLOC_*,
  TORCH_LOGS, SPPO_FX_LOG, ...) gets a zygote started with that environment (at most
  `MAX_ZYGOTES` live per process), or Popen when that fails.

The child is a `ForkedProcess`, with Popen's interface. Every child of one zygote shares
its string hash seed, as if PYTHONHASHSEED were set. `SPPO_TEST_FORK_LOG=path` appends a
JSON line per start (fork or popen, and why) to `path`.
"""
from __future__ import annotations

import atexit
import io
import json
import locale
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

ENV = "SPPO_TEST_FORK_RANKS"
LOG_ENV = "SPPO_TEST_FORK_LOG"
SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote_server.py")
READY_TIMEOUT_S = 300.0
MAX_ZYGOTES = 2
# Read when used (torch.distributed's rendezvous, sppo_fx's use-time settings, pytest's
# per-test marker), never at import by torch, transformers or sppo_fx (docs/testing.md)
SAFE_VARS = frozenset({
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "PYTEST_CURRENT_TEST",
    "SPPO_FX_CACHE_DIR", "SPPO_FX_MEMORY_MODEL_CACHE", "SPPO_FX_PROFILE_CACHE", "SPPO_FX_FORK",
    "SPPO_FX_RECALIBRATE", "SPPO_FX_LOG_PASSES", "SPPO_FX_BACKGROUND_COMPILE",
    "SPPO_TEST_FORK_RANKS", "SPPO_TEST_FORK_LOG",  # read by the test process only
})
_ALLOWED_KWARGS = {"stdin", "stdout", "stderr", "text", "universal_newlines", "encoding", "errors", "cwd", "bufsize"}


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def import_env(env: dict) -> frozenset:
    """What of `env` a process reads while it imports: all but `SAFE_VARS`."""
    return frozenset((k, v) for k, v in env.items() if k not in SAFE_VARS)


class ForkedProcess:
    """A rank forked by a zygote, with `subprocess.Popen`'s interface. The zygote (its
    parent) reports its exit status; signals go to its pid."""

    def __init__(self, args, pid, stdout, stderr):
        self.args, self.pid, self.stdin, self.stdout, self.stderr = args, pid, None, stdout, stderr
        self.returncode = None
        self._ended = threading.Event()
        self._readers = None
        self._output = {}

    def _exited(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._ended.set()

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, input=None, timeout=None):
        if input:
            raise ValueError("a forked rank has no stdin pipe")
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._readers is None:
            self._readers = []
            for name in ("stdout", "stderr"):
                stream = getattr(self, name)
                if stream is not None:
                    t = threading.Thread(target=self._read, args=(name, stream), daemon=True)
                    t.start()
                    self._readers.append(t)
        for t in self._readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self._output.get("stdout"), self._output.get("stderr")

    def _read(self, name, stream):
        try:
            self._output[name] = stream.read()
        finally:
            stream.close()

    def send_signal(self, sig):
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for s in (self.stdout, self.stderr):
            if s is not None and (self._readers is None):
                s.close()
        self.wait()


class Zygote:
    """One zygote process, started with `env`, and the thread that reads what it reports."""

    def __init__(self, env: dict):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log = tempfile.TemporaryFile()
        try:
            self.proc = subprocess.Popen([sys.executable, SERVER, str(theirs.fileno())], env=env,
                                         pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=self._log)
        finally:
            theirs.close()
        self.sock = ours
        self.alive = True
        self.ready = None
        self._replies: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # _procs and _early (the reader thread takes it too)
        self._request = threading.Lock()  # one request and its reply at a time
        self._procs: dict[int, ForkedProcess] = {}
        self._early: dict[int, int] = {}  # exits reported before the start's reply was handled
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                break
            msg = json.loads(data)
            if "exit" in msg:
                with self._lock:
                    proc = self._procs.pop(msg["exit"], None)
                    if proc is None:
                        self._early[msg["exit"]] = msg["code"]
                if proc is not None:
                    proc._exited(msg["code"])
                cpu_seconds[0] += msg.get("cpu_s", 0.0)
                _log_line({"exit": msg["exit"], "code": msg["code"], "cpu_s": msg.get("cpu_s")})
            else:
                self._replies.put(msg)
        self.alive = False
        self._replies.put({"error": "the zygote ended"})
        with self._lock:
            procs, self._procs = list(self._procs.values()), {}
        for proc in procs:  # the zygote's children die with it (PR_SET_PDEATHSIG)
            proc._exited(-signal.SIGKILL)

    def wait_ready(self) -> str | None:
        """None when ready, else why not."""
        if self.ready is None:
            try:
                msg = self._replies.get(timeout=READY_TIMEOUT_S)
            except queue.Empty:
                msg = {"error": f"not ready after {READY_TIMEOUT_S} s"}
            self.ready = msg
        if "ready" not in self.ready:
            return f"{self.ready.get('error')}: {self.stderr_tail()}"
        if self.ready["threads"] != 1 or self.ready["cuda"]:
            return f"zygote not fork-safe: {self.ready}"
        return None

    def stderr_tail(self) -> str:
        self._log.seek(0)
        return self._log.read()[-2000:].decode(errors="replace")

    def fork(self, argv, env, cwd, fds) -> int | str:
        """The child's pid, or why there is none."""
        why = self.wait_ready()
        if why is not None:
            return why
        msg = json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()
        with self._request:
            if not self.alive:
                return "the zygote ended"
            socket.send_fds(self.sock, [msg], fds)
            try:
                reply = self._replies.get(timeout=60)
            except queue.Empty:
                return "no reply within 60 s"
        return reply["pid"] if "pid" in reply else reply.get("error", str(reply))

    def adopt(self, proc: ForkedProcess) -> None:
        with self._lock:
            code = self._early.pop(proc.pid, None)
            if code is None and self.alive:
                self._procs[proc.pid] = proc
        if code is not None:
            proc._exited(code)
        elif not self.alive:
            proc._exited(-signal.SIGKILL)

    def busy(self) -> bool:
        """Whether a child it forked is still running (closing it would kill that child)."""
        with self._lock:
            return bool(self._procs)

    def close(self, timeout: float = 10.0) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


_zygotes: dict[frozenset, Zygote] = {}
_pool_lock = threading.Lock()
counts = {"fork": 0, "popen": 0}
cpu_seconds = [0.0]  # user + system seconds of the forked ranks that have ended


def _zygote_for(env: dict) -> Zygote:
    key = import_env(env)
    with _pool_lock:
        z = _zygotes.pop(key, None)
        if z is None or not z.alive:
            z = Zygote(env)
        _zygotes[key] = z  # most recently used last
        idle = [k for k, other in _zygotes.items() if other is not z and not other.busy()]
        for k in idle[:max(0, len(_zygotes) - MAX_ZYGOTES)]:  # least recently used first
            _zygotes.pop(k).close()
    return z


@atexit.register
def close_all() -> None:
    with _pool_lock:
        zygotes = list(_zygotes.values())
        _zygotes.clear()
    for z in zygotes:
        z.close()


def _log(cmd, env, how, why="", pid=None) -> None:
    counts[how] += 1
    _log_line({"how": how, "why": why, "pid": pid, "cmd": [os.path.basename(c) for c in cmd[:2]] + cmd[2:3],
               "rank": (env or {}).get("RANK")})


def _log_line(row: dict) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"t": time.time(), "test_pid": os.getpid(), **row}) + "\n")


def _unforkable(cmd, env, kwargs) -> str | None:
    if not enabled():
        return f"{ENV}=0"
    if env is None:
        return "no env= given"
    if len(cmd) < 2 or cmd[0] != sys.executable or cmd[1].startswith("-"):
        return "not [sys.executable, script, ...]"
    extra = set(kwargs) - _ALLOWED_KWARGS
    if extra:
        return f"Popen arguments {sorted(extra)}"
    if not os.path.isfile(os.path.join(kwargs.get("cwd") or os.getcwd(), cmd[1])):
        return "no script file"
    if kwargs.get("stdin") not in (None, subprocess.DEVNULL):
        return "stdin"
    return None


def _stream_fd(spec, default: int, opened: list) -> tuple[int, int | None]:
    """(descriptor for the child, our read end or None) for a Popen stdout/stderr argument."""
    if spec is None:
        return default, None
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        opened.append(fd)
        return fd, None
    if spec == subprocess.PIPE:
        r, w = os.pipe()
        opened.append(w)
        return w, r
    return (spec if isinstance(spec, int) else spec.fileno()), None


def _wrap(fd, kwargs):
    if fd is None:
        return None
    raw = io.open(fd, "rb", kwargs.get("bufsize", -1))
    if kwargs.get("text") or kwargs.get("universal_newlines") or kwargs.get("encoding") or kwargs.get("errors"):
        return io.TextIOWrapper(raw, encoding=kwargs.get("encoding") or locale.getpreferredencoding(False),
                                errors=kwargs.get("errors"))
    return raw


def start_process(cmd: list[str], *, env: dict | None = None, **kwargs):
    """A rank of `cmd`: forked from a zygote where it can be (module docstring), else Popen."""
    cmd = list(cmd)
    why = _unforkable(cmd, env, kwargs)
    if why is None:
        opened: list[int] = []
        reads = []
        try:
            stdin = os.open(os.devnull, os.O_RDONLY) if kwargs.get("stdin") == subprocess.DEVNULL else 0
            if stdin:
                opened.append(stdin)
            out, out_r = _stream_fd(kwargs.get("stdout"), 1, opened)
            if kwargs.get("stderr") == subprocess.STDOUT:
                err, err_r = out, None
            else:
                err, err_r = _stream_fd(kwargs.get("stderr"), 2, opened)
            reads = [r for r in (out_r, err_r) if r is not None]
            zygote = _zygote_for(env)
            cwd = os.fspath(kwargs["cwd"]) if kwargs.get("cwd") else os.getcwd()  # Popen's child starts in ours
            pid = zygote.fork(cmd, dict(env), cwd, [stdin, out, err])
        finally:
            for fd in opened:  # the child has its own copies now (or there is no child)
                os.close(fd)
        if isinstance(pid, int):
            proc = ForkedProcess(cmd, pid, _wrap(out_r, kwargs), _wrap(err_r, kwargs))
            zygote.adopt(proc)
            _log(cmd, env, "fork", pid=pid)
            return proc
        for r in reads:
            os.close(r)
        why = pid
    _log(cmd, env, "popen", why)
    return subprocess.Popen(cmd, env=env, **kwargs)
