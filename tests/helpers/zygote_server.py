"""The zygote process of tests/helpers/zygote.py: imports what rank scripts import, then forks
one child per request, which runs the requested script as `python script.py` would.

Started as `python zygote_server.py FD`, FD being its end of a SOCK_SEQPACKET socket pair.
Messages are JSON, one per packet:

- zygote -> client, once: {"ready": pid, "threads": n, "cuda": bool, "seconds": s}
- client -> zygote: {"argv": [...], "env": {...}, "cwd": path or null} with three file
  descriptors (the child's stdin, stdout, stderr) as SCM_RIGHTS ancillary data
- zygote -> client: {"pid": pid} or {"error": why} (then the client starts the rank with Popen)
- zygote -> client, when a child ends: {"exit": pid, "code": code as Popen's returncode,
  "cpu_s": the child's and its waited-for children's user + system seconds}

The zygote stays single-threaded (a fork copies only the calling thread: a pool thread's
locks would stay held in the child) and runs no tensor op. It ends, killing its children,
when the client's end closes, and dies with its parent (PR_SET_PDEATHSIG).
"""
import ctypes
import importlib
import json
import os
import select
import signal
import socket
import sys
import time

PR_SET_PDEATHSIG = 1
MAX_MESSAGE = 1 << 20
# what the rank scripts under tests/helpers and examples/ import (a module imported here
# costs the zygote once instead of every rank; see docs/testing.md for what was measured)
PRELOAD = ("torch", "torch.distributed", "torch.export", "torch._export", "sympy", "sppo_fx", "sppo_fx.api",
           "sppo_fx.models", "sppo_fx.runtime.distributed", "sppo_fx.orchestrate", "sppo_fx.runtime.pipeline")
UNFROZEN = ("torch._dynamo", "torch._functorch.aot_autograd", "transformers")  # see _preload_unfrozen
# the Hugging Face classes the rank scripts build (transformers imports each model's module
# when its attribute is first read)
HF_CLASSES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM",
              "Gemma3ForCausalLM", "Phi3ForCausalLM", "PhiForCausalLM", "GPT2LMHeadModel", "GPTNeoXForCausalLM")


def _die_with_parent(parent: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent ended before the call above
        os._exit(1)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _import(names) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def _preload_unfrozen() -> None:
    """Freeze what is imported so far (`gc.freeze`: the children's collections, and their
    exit's, leave those objects' pages shared, 1 CPU-s a rank), then import what must stay
    collectable: Dynamo brings Triton, whose objects in reference cycles, never collected
    when frozen, make nanobind print "leaked instances" at every child's exit."""
    import gc
    gc.collect()
    gc.freeze()
    _import(UNFROZEN)
    tf = sys.modules.get("transformers")
    for name in HF_CLASSES if tf is not None else ():
        try:
            getattr(tf, name)
        except (ImportError, AttributeError):
            pass
    gc.collect()


def _send(sock, msg) -> None:
    sock.send(json.dumps(msg).encode())


def _script_frames(tb, path):
    """The traceback from the script's first frame on (as `python script.py` prints it)."""
    t = tb
    while t is not None and t.tb_frame.f_code.co_filename != path:
        t = t.tb_next
    return t if t is not None else tb


def _run_main(path: str) -> None:
    """Run the file at `path` as the `__main__` module, as `python path` does."""
    import builtins
    import importlib.machinery
    import types
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __builtins__=builtins,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    sys.modules["__main__"] = main
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def _child(req, fds, closing) -> None:
    """In the forked child: become `python argv[1] argv[2:]` with the request's environment,
    working directory and standard streams; never returns (ends with SystemExit)."""
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in closing:
            os.close(fd)
        _die_with_parent(int(req["zygote"]))
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds) - {0, 1, 2}:
            os.close(fd)
        if req.get("cwd"):
            os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        path = os.path.abspath(req["argv"][1])
        sys.argv = list(req["argv"][1:])  # argv[0] as given, __file__ absolute (as python does)
        sys.path[0] = os.path.dirname(os.path.realpath(path))  # as `python script.py` sets it
        importlib.invalidate_caches()  # files written since the zygote's imports (a fresh one has no cache)
        import random
        random.seed()  # a fresh interpreter's state, not the zygote's (copied to every child)
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
    except BaseException:
        import traceback
        traceback.print_exc()
        os._exit(1)
    try:
        _run_main(path)
    except SystemExit:
        raise  # the interpreter prints a message code and turns the code into the exit status
    except BaseException as e:
        sys.excepthook(type(e), e, e.with_traceback(_script_frames(e.__traceback__, path)).__traceback__)
        raise SystemExit(1)
    raise SystemExit(0)


def main() -> None:
    start = time.monotonic()
    parent = os.getppid()
    _die_with_parent(parent)
    sock = socket.socket(fileno=int(sys.argv[1]))
    _import(PRELOAD)
    _preload_unfrozen()
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below through wake_w
    signal.set_wakeup_fd(wake_w)
    torch = sys.modules.get("torch")
    cuda = bool(torch is not None and torch.cuda.is_initialized())
    _send(sock, {"ready": os.getpid(), "threads": _threads(), "cuda": cuda, "seconds": time.monotonic() - start})
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([sock, wake_r], [], [], 1.0)
        if wake_r in readable:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
        while children:  # reap every ended child, and say so
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status),
                         "cpu_s": usage.ru_utime + usage.ru_stime})
        if sock not in readable:
            continue
        data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 3)
        if not data:  # the client is gone: so are its ranks
            for pid in children:
                os.kill(pid, signal.SIGKILL)
            os._exit(0)
        req = json.loads(data)
        threads = _threads()
        if len(fds) != 3 or threads != 1:
            for fd in fds:
                os.close(fd)
            _send(sock, {"error": f"{len(fds)} descriptors" if len(fds) != 3 else f"the zygote has {threads} threads"})
            continue
        req["zygote"] = os.getpid()
        pid = os.fork()
        if pid == 0:
            _child(req, fds, [sock.detach(), wake_r, wake_w])
        for fd in fds:
            os.close(fd)
        children.add(pid)
        _send(sock, {"pid": pid})


if __name__ == "__main__":
    main()
