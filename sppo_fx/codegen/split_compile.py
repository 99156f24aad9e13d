"""Compile a training program's backward graph in a forked child while this process compiles
its forward graph.

AOTAutograd hands Inductor a program's forward graph and then its backward graph (at once,
not at the first backward, when shapes are dynamic), one after the other in one process;
each compile is mostly Python work under the GIL. On the bench model (`bench/first_step.py`)
the backward graph is about two thirds of Inductor's time. With a `BackwardInChild`:

1. the memory partitioner forks once it has split the joint graph (`fork`); both processes
   now hold the same forward and backward graphs, and the same symbolic shapes;
2. the child skips the forward graph (`forward_stub`: a function that is never run) and
   compiles the backward graph, which Inductor writes to its FX graph cache on disk; then
   it exits (`compile_backward_in_child`);
3. this process compiles the forward graph meanwhile; at the backward graph it waits for the
   child (`wait_for_child`) and compiles the backward graph, which Inductor finds in its
   cache.

What this process runs is what Inductor's cache returns for its own graph: the cache key
covers the graph, its inputs and the configuration, and the entry's shape guards are checked
against this process's sizes, as for an entry that an earlier run wrote. A child that fails,
dies or runs past its time writes no entry (or one this key never finds), and this process
compiles the backward graph itself: the child can only make the compile faster.

Used only where forking is safe and the cache is on (`eligible`): `can_fork()`, CPU
tensors, CUDA not initialised in this process, Inductor's FX graph cache enabled.
"""
from __future__ import annotations

import time
from typing import Callable, NoReturn

import torch

from sppo_fx.forked import ForkedChild, can_fork
from sppo_fx.log import get_logger, phase

log = get_logger(__name__)

# This process waits for the child at least this long, or 4x its own time since the fork
# (the forward graph's compile; the backward graph takes about 2x that), whichever is more.
MIN_WAIT_S = 120.0
WAIT_FACTOR = 4.0


def eligible(example_inputs) -> bool:
    """Whether a `BackwardInChild` may fork for a compile of these inputs."""
    from torch._inductor import config as inductor_config
    if not can_fork() or torch.cuda.is_initialized():
        return False
    if not inductor_config.fx_graph_cache or inductor_config.force_disable_caches:
        return False  # nothing the child compiles would reach this process
    return all(t.device.type == "cpu" for t in example_inputs if isinstance(t, torch.Tensor))


class BackwardInChild:
    """One compile's fork (see the module docstring).

    Args:
        what: the compile's label (debug messages, the wait's progress line).
        before_fork: called in this process just before it forks (joins threads whose
            locks the child must not inherit mid-use).

    Attributes:
        from_child: whether this process's backward graph came from Inductor's cache after
            the child compiled it (set by `compile_backward`).
    """

    def __init__(self, what: str, before_fork: Callable[[], None] = lambda: None):
        self.what, self.before_fork = what, before_fork
        self.child = ForkedChild(f"{what}: the backward graph")
        self.forked = False
        self.from_child = False

    @property
    def in_child(self) -> bool:
        return self.child.in_child

    def fork(self) -> None:
        """Fork once (later calls do nothing). In the child, Inductor's compile threads are
        made anew (the parent's pool threads do not exist there), and the child runs torch on
        one thread (`sppo_fx/forked.py`: an OpenMP parallel region in a forked child hangs)
        while Inductor reads this process's thread count: the generated C++ code and the
        cache key hold it."""
        if self.forked:
            return
        self.forked = True
        self.before_fork()
        threads = torch.get_num_threads()
        if self.child.fork() and self.child.in_child:
            from torch._inductor.async_compile import AsyncCompile
            AsyncCompile.pool.cache_clear()
            torch.get_num_threads = lambda: threads  # Inductor's `parallel_num_threads()`

    def forward_stub(self, gm: torch.fx.GraphModule):
        """The child's stand-in for the compiled forward graph: AOTAutograd only wraps it."""
        from functorch.compile import make_boxed_func
        return make_boxed_func(gm.forward)

    def compile_backward(self, compile_fn: Callable[[], object]):
        """The backward graph's compile (`compile_fn()`, Inductor's inner compile): in the
        child, compiled for the cache, then the child exits; here, once the child is done,
        so that Inductor finds it in the cache."""
        if self.in_child:
            self._compile_in_child(compile_fn)
        child_ok = self._wait_for_child() if self.child.pid is not None else False
        from torch._dynamo.utils import counters
        hits = counters["inductor"]["fxgraph_cache_hit"]
        out = compile_fn()
        self.from_child = child_ok and counters["inductor"]["fxgraph_cache_hit"] > hits
        if child_ok and not self.from_child:
            log.debug("%s: the forked child compiled the backward graph, but Inductor's cache "
                      "did not return it here (compiled here)", self.what)
        return out

    def _compile_in_child(self, compile_fn) -> NoReturn:
        try:
            compile_fn()
        except BaseException as e:  # noqa: BLE001 - this process compiles it itself
            self.child.exit_with(f"{type(e).__name__}: {e}".encode(), 1)
        self.child.exit_with(b"ok")

    def _wait_for_child(self) -> bool:
        """Wait for the child (reaped either way); whether it compiled the backward graph."""
        waited = time.perf_counter() - self.child.started
        timeout = max(MIN_WAIT_S, WAIT_FACTOR * waited)
        with phase(f"{self.what}: waiting for the backward graph's compile in a forked process", log):
            payload, why = self.child.receive(timeout)
        if payload != b"ok":
            log.debug("%s: the forked child %s; compiling the backward graph here", self.what,
                      why or f"failed: {payload.decode(errors='replace')}")
        return payload == b"ok"

    def leave(self) -> None:
        """At the end of the compile, whatever happened: a child that got this far has left
        the backward graph's compile without exiting (an error, or no eager backward
        compile): it exits now, never returning into the caller's code. Here, the child is
        reaped (killed if it still runs)."""
        if self.in_child:
            self.child.exit_with(b"the child left the compile", 1)
        self.child.stop()

