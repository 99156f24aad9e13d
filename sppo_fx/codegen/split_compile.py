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
   it exits (`compile_backward`);
3. this process compiles the forward graph meanwhile; at the backward graph it waits for the
   child (`compile_backward` again) and compiles the backward graph, which Inductor finds
   in its cache.

The child cannot change what this process runs: that is what Inductor's cache returns for
this process's own graph (the key covers the graph, its inputs and the configuration; the
entry's shape guards are checked against this process's sizes and added to its shape
environment), as for an entry an earlier run wrote. What it can cost is the wait: a child
that fails, bypasses the cache or runs past its time writes no entry this key finds, and this
process then compiles the backward graph itself after waiting. A child past its time is not
killed (its C++ compiles write the kernel libraries in place, and Inductor's file locks die
with it): it finishes on its own, reaped in the background, or is ended by its own alarm
after `CHILD_LIMIT_S`.

Used only where forking is safe and helps (`eligible`, `fork`): `can_fork()`, CPU tensors,
CUDA not initialised in this process, Inductor's FX graph cache enabled, a backward graph
that AOTAutograd compiles at once (it takes symbolic sizes from the forward graph), and a
core free for the child at the fork (`forked.a_core_is_free`: on a machine whose cores are
taken, by a test suite's workers or other jobs, a child only adds its overheads).
"""
from __future__ import annotations

import time
from typing import Callable, NoReturn

import torch

from sppo_fx.util.forked import ForkedChild, a_core_is_free, can_fork
from sppo_fx.util.log import get_logger, phase

log = get_logger(__name__)

# This process waits for the child at least this long, or 4x its own time since the fork
# (the forward graph's compile; the backward graph takes about 2x that), whichever is more.
MIN_WAIT_S = 120.0
WAIT_FACTOR = 4.0
# A child still running this long after the fork ends itself (SIGALRM): a child stuck on a
# lock it inherited would otherwise hold a copy of this process's memory for ever.
CHILD_LIMIT_S = 7200


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
        before_fork: called in this process just before it forks; False means do not fork
            (it waits for threads whose locks the child must not inherit mid-use).

    Attributes:
        from_child: whether this process's backward graph came from Inductor's cache after
            the child compiled it (set by `compile_backward`).
    """

    def __init__(self, what: str, before_fork: Callable[[], bool] = lambda: True):
        self.what, self.before_fork = what, before_fork
        self.child = ForkedChild(f"{what}: the backward graph")
        self.forked = False
        self.from_child = False

    @property
    def in_child(self) -> bool:
        return self.child.in_child

    def fork(self, backward: torch.fx.GraphModule | None = None) -> None:
        """Fork once (later calls do nothing), unless `backward` (the partitioned backward
        graph) takes no symbolic size from the forward graph: AOTAutograd then compiles it
        lazily, at the first backward, after this compile. In the child, Inductor's compile
        threads are made anew (the parent's pool threads do not exist there), and the child
        runs torch on one thread (`sppo_fx/util/forked.py`: an OpenMP parallel region in a
        forked child hangs) while Inductor reads this process's thread count: the generated
        C++ code and the cache key hold it."""
        if self.forked:
            return
        self.forked = True
        if backward is not None and not _takes_symbolic_sizes(backward):
            return
        if not self.before_fork():
            return
        if not a_core_is_free():  # the two compiles would share this process's core
            log.debug("%s: no core free for a forked child; compiling both graphs here", self.what)
            return
        threads = torch.get_num_threads()
        if self.child.fork() and self.child.in_child:
            try:
                import signal
                signal.signal(signal.SIGALRM, signal.SIG_DFL)  # not a handler the parent set
                signal.alarm(CHILD_LIMIT_S)
                from torch._inductor.async_compile import AsyncCompile
                AsyncCompile.pool.cache_clear()
                torch.get_num_threads = lambda: threads  # Inductor's `parallel_num_threads()`
            except BaseException:  # noqa: BLE001 - the child never returns into the caller
                self.child.exit_with(b"the child could not start", 1)

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
        payload, code = b"the child failed", 1
        try:
            from torch._dynamo.utils import counters
            bypassed = counters["inductor"]["fxgraph_cache_bypass"]
            compile_fn()
            if counters["inductor"]["fxgraph_cache_bypass"] > bypassed:
                payload = b"Inductor did not cache the backward graph"
            else:
                payload, code = b"ok", 0
        except BaseException as e:  # noqa: BLE001 - this process compiles it itself
            try:
                payload = f"{type(e).__name__}: {e}".encode(errors="replace")
            except BaseException:  # noqa: BLE001 - an exception that cannot be described
                pass
        finally:
            self.child.exit_with(payload, code)

    def _wait_for_child(self) -> bool:
        """Wait for the child; whether it compiled the backward graph. A child past its
        time is left to finish (module docstring)."""
        waited = time.perf_counter() - self.child.started
        timeout = max(MIN_WAIT_S, WAIT_FACTOR * waited)
        with phase(f"{self.what}: waiting for the backward graph's compile in a forked process", log):
            payload, why = self.child.receive(timeout, kill=False)
        if payload != b"ok":
            log.debug("%s: the forked child %s; compiling the backward graph here", self.what,
                      why or f"failed: {payload.decode(errors='replace')}")
        return payload == b"ok"

    def leave(self) -> None:
        """At the end of the compile, whatever happened: a child that got this far has left
        the compile without exiting (an error before the backward graph, or a backward graph
        compiled lazily): it exits now, never returning into the caller's code. Here, a child
        still running (this process's compile failed first) is left to finish and reaped in
        the background."""
        if self.in_child:
            self.child.exit_with(b"the child left the compile", 1)
        self.child.detach()


def _takes_symbolic_sizes(backward: torch.fx.GraphModule) -> bool:
    """Whether the backward graph has a SymInt input (AOTAutograd's test for compiling it at
    once: `num_symints_saved_for_bw > 0`)."""
    return any(isinstance(n.meta.get("val"), torch.SymInt)
               for n in backward.graph.nodes if n.op == "placeholder")

