"""Chunk 0's exact-size programs (`ExactSizeGraphs`): AOTAutograd's graphs op by op at once,
Inductor's code once a background thread has compiled them.

Chunk 0 (an empty K/V prefix) would cost the first call a second Inductor compile
(`CompiledProgram`, `eager_empty_prefix`), so the first call runs its AOTAutograd graphs op
by op. In the steady state that costs: under a budget chunk 0 is often the longest chunk
(small Llama, T = 2048, 25% budget: docs/first-call-and-caches.md). So from chunk 0's
second call (the first step is over by then) a background thread compiles the same
program, at the same sizes, with Inductor and the same memory passes, and the next call
after it is done runs Inductor's code. The first call pays nothing for it; the steps that
overlap the compile share the cores with it; a second process finds the compile in
Inductor's FX graph cache.

Thread safety: the compile holds Dynamo's compile lock (`torch._dynamo.convert_frame.
compile_lock`), which every Dynamo compile in this process takes too, and chunk 0's exact
traces (`CompiledProgram._trace_exact`) take it as well, so no two compiles or traces run
at once; Inductor's per-graph state is thread-local (`torch._inductor.virtualized`), fake
tensor modes and grad mode are per thread. What runs meanwhile on the caller's thread is
compiled code and op-by-op graphs. Its inputs are fake copies made on the caller's thread
(no real memory held). The backward graph is compiled with the forward graph
(`force_non_lazy_backward_lowering`), not at the first backward, which would be on the
training thread. A failed compile leaves chunk 0 on its op-by-op graphs, with a warning.

`SPPO_FX_BACKGROUND_COMPILE=off` keeps chunk 0 on its op-by-op graphs (no thread).
"""
from __future__ import annotations

import functools
import os
import threading
from typing import Callable

import torch
import torch.fx as fx

from sppo_fx.util.log import get_logger

log = get_logger(__name__)


_threads: list[threading.Thread] = []  # every background compile's thread (`wait_all`)


def wait_all(timeout: float | None = None) -> bool:
    """Wait for every background compile of this process, at most `timeout` seconds each;
    whether none is running now."""
    for thread in list(_threads):
        thread.join(timeout)
    return not any(t.is_alive() for t in _threads)


@functools.cache
def _register_stop_at_exit() -> None:
    # runs when the main thread ends, before Python joins the other threads
    threading._register_atexit(_stop_at_exit)


def _stop_at_exit() -> None:
    """At exit, end the background compiles still running: SystemExit raised in each thread at
    its next Python instruction (the compile is mostly Python; context managers release its
    locks). Nothing is lost but the compile, and Inductor's cache writes are atomic. A
    thread still running after 60 s (waiting in C code) is joined by Python's shutdown."""
    import ctypes
    import time
    for thread in _threads:
        if thread.is_alive():
            log.info("ending chunk 0's background compile at exit")
        end = time.monotonic() + 60
        # again until it ends: one landing in a callback whose exceptions are ignored
        # (a weakref's) is lost
        while thread.is_alive() and thread.ident is not None and time.monotonic() < end:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(SystemExit))
            thread.join(0.5)


def enabled() -> bool:
    """Whether chunk 0's exact-size programs are compiled in the background."""
    return os.environ.get("SPPO_FX_BACKGROUND_COMPILE", "on").lower() not in ("off", "0", "false", "no")


def fake_copies(tensors) -> list:
    """Fake tensors of these tensors' sizes, strides, dtypes, devices and requires_grad, in one
    fake mode with static shapes: what the background compile traces with."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=False)
    return [mode.from_tensor(t.detach().requires_grad_(t.requires_grad), static_shapes=True) for t in tensors]


class ExactProgram:
    """One exact-size program of chunk 0: `eager(*tensors)` until `compiled` is set.

    Args:
        eager: AOTAutograd's graphs run op by op (a callable of the tensor arguments).
        compile: given the tensor arguments of a call, returns what the background thread
            runs: a function with no arguments returning the compiled callable. None: never
            compile (not an Inductor program, or background compiles are off).
        stats: the program's `CodegenStats` (calls and compiles are counted there).
        name: for messages.
    """

    def __init__(self, eager: Callable, compile: Callable | None, stats, name: str):
        self.eager, self.compile, self.stats, self.name = eager, compile, stats, name
        self.compiled: Callable | None = None
        self.thread: threading.Thread | None = None
        self.failed = False
        self.calls = 0

    def __call__(self, *tensors):
        fn = self.compiled
        if fn is not None:
            self.stats.exact_compiled_calls += 1
            return fn(*tensors)
        self.calls += 1
        if self.calls == 2 and self.compile is not None:
            self._start(tensors)  # the first call (its step) is over
        self.stats.exact_eager_calls += 1
        return self.eager(*tensors)

    def _start(self, tensors) -> None:
        job = self.compile(tensors)
        grad = torch.is_grad_enabled()

        def run():
            from torch._dynamo.convert_frame import compile_lock
            try:
                with compile_lock, torch.set_grad_enabled(grad):
                    fn = job()
                self.stats.background_compiles += 1
                self.compiled = fn  # one assignment: the caller's next call takes it
            except Exception:  # noqa: BLE001 - the op-by-op graphs stay, and stay exact
                self.failed = True
                self.stats.background_failures += 1
                log.warning("compiling %s for chunk 0 in the background failed; chunk 0 keeps "
                            "AOTAutograd's graphs op by op", self.name, exc_info=True)

        # not a daemon: a daemon thread inside Inductor's C++ build at interpreter exit
        # aborts the process ("terminate called without an active exception"); `_stop_at_exit`
        # ends it instead
        self.thread = threading.Thread(target=run, name="sppo_fx-chunk0-compile", daemon=False)
        _threads.append(self.thread)
        _register_stop_at_exit()
        self.thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a background compile under way; whether none is running now."""
        if self.thread is not None:
            self.thread.join(timeout)
            return not self.thread.is_alive()
        return True


class ExactSizeGraphs:
    """A program traced once per distinct call signature (no guards, no symbolic sizes), for
    up to `limit` distinct argument sizes; calls of any other size go to one dynamic program.

    The signature is every tensor argument's shape, stride, dtype, device and requires_grad,
    every other argument's value (the sizes), and whether grad mode is on: any difference
    traces again, as a failed guard would recompile. `trace(args)` returns a callable of the
    tensor arguments, in order; `dynamic()` a callable of all of them, made on first need."""

    def __init__(self, trace, limit: int, dynamic):
        self.trace, self.limit, self.make_dynamic = trace, limit, dynamic
        self.programs: dict = {}  # (grad mode, requires_grad per tensor, sizes) -> traced program
        self.dynamic = None

    def __call__(self, *args):
        sizes = tuple((tuple(a.shape), a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor)
                      else (type(a), a) for a in args)
        grads = tuple(a.requires_grad for a in args if isinstance(a, torch.Tensor))
        key = (torch.is_grad_enabled(), grads, sizes)  # training and evaluation: one size, two traces
        fn = self.programs.get(key)
        if fn is None:
            seen = {k[2] for k in self.programs}
            if sizes not in seen and len(seen) >= self.limit:
                if self.dynamic is None:
                    self.dynamic = self.make_dynamic()
                return self.dynamic(*args)
            fn = self.programs[key] = self.trace(args)
        return fn(*[a for a in args if isinstance(a, torch.Tensor)])


def with_constants(gm: fx.GraphModule, args) -> fx.GraphModule:
    """`gm` with its non-tensor placeholders replaced by their values in `args` (chunk 0's
    `chunk_start` and sizes): a GraphModule of the tensor arguments alone, in order, as
    `over_tensor_args` makes a function of them (Inductor compiles GraphModules)."""
    graph = fx.Graph()
    env: dict = {}
    placeholders = iter(args)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            value = next(placeholders)
            env[node] = graph.node_copy(node, env.__getitem__) if isinstance(value, torch.Tensor) else value
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
    return fx.GraphModule(gm, graph, class_name=type(gm).__name__)
