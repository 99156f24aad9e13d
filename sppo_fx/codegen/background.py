"""Chunk 0's exact-size programs (`ExactSizeGraphs`): AOTAutograd's graphs op by op at once,
Inductor's code once a forked child has compiled them into Inductor's cache.

Chunk 0 (an empty K/V prefix) would cost the first call a second Inductor compile
(`CompiledProgram`, `eager_empty_prefix`), so the first call runs its AOTAutograd graphs op
by op; in the steady state that costs Inductor's fusions in the longest chunk of a budget's
plan. So at chunk 0's second call (the first step is over) a forked child compiles the same
program, at the same sizes, with Inductor and the same memory passes, into Inductor's FX
graph cache (inputs: fake copies; the backward graph at once,
`force_non_lazy_backward_lowering`). Chunk 0 runs op by op meanwhile; at its first call
after the child has exited, this process compiles the program itself, which Inductor's
cache serves (an AOTAutograd trace and partition, no code generation), and runs it from
then on. A second process finds it all in the cache.

Not a thread: AOTAutograd's and Inductor's traces (make_fx) patch `torch.nn.Module.__call__`
for the whole process while they run, and the training thread's next module call was traced
into them ("using FX to symbolically trace a dynamo-optimized function"). Without a fork
(no FX graph cache, CUDA initialised) the compile runs here at the next call. A failed
compile leaves chunk 0 on its op-by-op graphs, with a warning.

`SPPO_FX_BACKGROUND_COMPILE` = auto (the default) | on | wait | off. `on` compiles beside
the steps; `wait` starts the compile at chunk 0's second call and waits for it there, so
that one step pays the compile and every later one runs Inductor's code; `off` keeps chunk 0
op by op. `auto` (`auto_decision`) is `on` where the compile does not take the training
step's cores: a CPU program whose usable cores exceed the step's intra-op threads
(`torch.get_num_threads()`, times the local pipeline ranks), where a child can fork and
Inductor's FX graph cache is on, started at a call that finds a core free
(`forked.a_core_is_free`, checked again at each later call of chunk 0); or a CUDA program
(the step runs on the GPU; no fork once CUDA is initialised, so the compile runs in this
process at chunk 0's next call: that one step pays it). Where the step's threads take every
core, or no child can fork, `auto` is `wait` (`off` in a rank of a larger process group,
CPU or GPU, whose peers would wait on it past their timeout): on the 2-core CPU machine (2 intra-op threads)
a child's compile beside the training steps slowed every one of them (the demo's steps 1-4
ran at 6.4 s with it against 1.6 s without), and keeping chunk 0 op by op for good cost
the steady step about 10% (the demo: 0.93 s against 0.81-0.83 s with chunk 0 compiled;
docs/first-call-and-caches.md).
"""
from __future__ import annotations

import os
import weakref
from typing import Callable

import torch
import torch.fx as fx

from sppo_fx.util.log import get_logger
from sppo_fx.util.rss import give_back_free_heap, rss_bytes

log = get_logger(__name__)


def wait_all(timeout: float | None = None) -> bool:
    """Take every chunk-0 compile under way of this process (`ExactProgram.wait`)."""
    return all([p.wait(timeout) for p in list(_programs)])


_programs: weakref.WeakSet = weakref.WeakSet()  # every ExactProgram (`wait_all`)


ENV = "SPPO_FX_BACKGROUND_COMPILE"
# on: a forked child compiles beside the steps; wait: chunk 0's second call compiles (in a
# forked child where one can fork: its memory stays out of this process) and waits for it;
# off: chunk 0 keeps AOTAutograd's graphs op by op
MODES = ("on", "wait", "off")
_ON, _OFF = ("on", "1", "true", "yes"), ("off", "0", "false", "no")


def setting() -> str:
    """`SPPO_FX_BACKGROUND_COMPILE` as "auto" (unset or empty), "on", "wait" or "off"."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in _ON:
        return "on"
    if value == "wait":
        return "wait"
    if value in _OFF:
        return "off"
    from sppo_fx.errors import SppoError
    raise SppoError(f"environment variable {ENV}={value!r}: set it to auto, on, wait or off, or unset it (auto)")


def auto_decision(device: str, usable_cores: int, threads: int, forks: bool, local_ranks: int = 1,
                  world: int = 1) -> tuple[str, str]:
    """`auto`'s choice for a program on `device` ("cpu", "cuda", ...) whose step runs
    `threads` intra-op threads in each of `local_ranks` processes on this machine (pipeline
    ranks), with `usable_cores` cores for this process, where a child can (`forks`) or
    cannot be forked for the compile, in a process group of `world` ranks: (mode, why),
    mode one of `MODES`."""
    if not device.startswith(("cpu", "cuda")):
        return "off", f"no Inductor compile of chunk 0 for {device} programs"
    busy = threads * max(local_ranks, 1)
    # where chunk 0's compile would run inside a step of this process: on CUDA (no child once
    # it is initialised), or a CPU with no child to fork or no core free for one
    in_a_step = device.startswith("cuda") or not forks or usable_cores <= busy
    if world > 1 and in_a_step:
        return "off", (f"one of {world} ranks: a step that compiled chunk 0 would keep its peers waiting "
                       "past their timeout, and no child can compile it beside the steps")
    if device.startswith("cuda"):
        return "on", "the step runs on the GPU; the host compiles chunk 0 at its next call"
    if not forks:
        return "wait", ("no forked child (no os.fork, SPPO_FX_FORK=off or no FX graph cache): chunk 0's "
                        "second call compiles it here, and that step pays the compile")
    if usable_cores <= busy:
        return "wait", (f"the step's {threads} intra-op threads x {local_ranks} local rank(s) take all "
                        f"{usable_cores} usable cores: a child beside the steps would slow every one of them, "
                        "so chunk 0's second call compiles it and waits, and that step pays the compile")
    return "on", (f"{usable_cores} usable cores, {threads} intra-op threads x {local_ranks} local rank(s): "
                  "a core is free for the child")


def local_ranks() -> int:
    """Training processes on this machine: torchrun's LOCAL_WORLD_SIZE, or WORLD_SIZE for
    ranks started on one machine (`runtime.launch`: LOCAL_RANK without LOCAL_WORLD_SIZE),
    else 1."""
    for var in ("LOCAL_WORLD_SIZE",) + (("WORLD_SIZE",) if "LOCAL_RANK" in os.environ else ()):
        try:
            return max(int(os.environ[var]), 1)
        except (KeyError, ValueError):
            continue
    return 1


def mode(device: str = "cpu") -> str:
    """How chunk 0's exact-size programs on `device` get Inductor's code, one of `MODES`
    (`setting`; with "auto", `auto_decision` on this machine)."""
    chosen = setting()
    if chosen != "auto":
        return chosen
    from sppo_fx.util.forked import can_fork, usable_cpus
    forks = can_fork() and _cache_on() and not torch.cuda.is_initialized()  # as `_start` asks
    chosen, why = auto_decision(device, usable_cpus(), torch.get_num_threads(), forks, local_ranks(), _world())
    log.debug("chunk 0's compile (%s=auto): %s, %s", ENV, chosen, why)
    return chosen


def _world() -> int:
    """Ranks of the default process group (1 outside one)."""
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def enabled(device: str = "cpu") -> bool:
    """Whether chunk 0's exact-size programs on `device` are ever compiled by Inductor."""
    return mode(device) != "off"


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
        compile: given the tensor arguments of a call, returns the compile job: a function
            with no arguments returning the compiled callable. None: never compile (not an
            Inductor program, or background compiles are off).
        stats: the program's `CodegenStats` (calls and compiles are counted there).
        name: for messages.
        device: the program's device type ("cpu", "cuda").
        wait: the call that starts the compile waits for it and runs Inductor's code (mode
            "wait"); otherwise the compile runs beside the next calls (mode "on").
    """

    def __init__(self, eager: Callable, compile: Callable | None, stats, name: str, device: str = "cpu",
                 wait: bool = False):
        self.eager, self.compile, self.stats, self.name, self.device = eager, compile, stats, name, device
        self.wait_for_it = wait
        self.started = False
        self.next_check = 0.0  # monotonic time of the next look for a free core (`_may_start`)
        self.compiled: Callable | None = None
        self.child = None  # the forked child compiling into Inductor's cache
        self.job: Callable | None = None
        self.grad = True
        self.calls = 0
        _programs.add(self)

    def __call__(self, *tensors):
        if self.compiled is None and self.job is not None and not self._child_running():
            self._finish()
        fn = self.compiled
        if fn is not None:
            self.stats.exact_compiled_calls += 1
            return fn(*tensors)
        self.calls += 1
        if self.calls >= 2 and self.compile is not None and self.job is None and self._may_start():
            self._start(tensors)  # the first call (its step) is over
            if self.wait_for_it:  # this call pays the compile
                if not self.wait(WAIT_LIMIT_S):
                    self._compile_here_instead()
                if self.compiled is not None:
                    self.stats.exact_compiled_calls += 1
                    return self.compiled(*tensors)
        return self._eager(tensors)

    def _eager(self, tensors):
        self.stats.exact_eager_calls += 1
        return self.eager(*tensors)

    def _may_start(self) -> bool:
        """Whether to start the compile now: once; under `auto` on a CPU, while a core is free
        for the child (a machine busy with other work is asked again at the next call)."""
        if self.started:
            return False
        if self.device.startswith("cpu") and setting() == "auto" and not self.wait_for_it:
            import time
            from sppo_fx.util.forked import a_core_is_free
            if time.monotonic() < self.next_check:
                return False
            if not a_core_is_free():  # ~40 ms of sampling: not at every call of a busy machine
                self.next_check = time.monotonic() + RECHECK_S
                return False
        self.started = True
        return True

    def _start(self, tensors) -> None:
        from sppo_fx.util.forked import ForkedChild, can_fork
        self.job, self.grad = self.compile(tensors), torch.is_grad_enabled()
        if not (can_fork() and not torch.cuda.is_initialized() and _cache_on()):
            return  # compiled here at the next call
        threads = torch.get_num_threads()
        child = ForkedChild(f"{self.name}: chunk 0's compile")
        if not child.fork():
            return
        if not child.in_child:
            self.child = child
            return
        code = 1
        try:
            import signal
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(CHILD_LIMIT_S)  # a child stuck on a lock inherited mid-use ends
            from torch._inductor.async_compile import AsyncCompile
            AsyncCompile.pool.cache_clear()  # the parent's pool threads do not exist here
            torch.get_num_threads = lambda: threads  # the parent's count: in the code and the key
            self.job()
            code = 0
        finally:
            child.exit_with(b"", code)  # never returns

    def running(self) -> bool:
        """Whether a forked child compiles beside the steps now; takes nothing (`wait`
        takes a finished compile, and compiles here where no child did)."""
        return self._child_running()

    def _child_running(self) -> bool:
        if self.child is None or self.child.pid is None:
            return False
        done, _status = os.waitpid(self.child.pid, os.WNOHANG)
        if done == 0:
            return True
        self.child.pid = None  # reaped
        self.child._close()
        return False

    def _finish(self) -> None:
        """Compile here (Inductor's cache holds what the child compiled); on failure chunk 0
        keeps its op-by-op graphs, which are exact."""
        job, self.job = self.job, None
        give_back_free_heap()  # the growth below is then the compile's, not earlier garbage's
        before = rss_bytes()
        try:
            with torch.set_grad_enabled(self.grad):
                self.compiled = job()
        except Exception:  # noqa: BLE001 - the op-by-op graphs stay, and stay exact
            self.stats.background_failures += 1
            log.warning("compiling %s for chunk 0 failed; chunk 0 keeps AOTAutograd's graphs op by op",
                        self.name, exc_info=True)
            return
        self.stats.background_compiles += 1
        give_back_free_heap()  # what RSS holds after it is the program's, not freed scratch
        self.stats.background_compile_rss_bytes += max(rss_bytes() - before, 0)

    def _compile_here_instead(self) -> None:
        """Mode "wait" with a child still compiling after `WAIT_LIMIT_S` (stuck, say, on a
        lock it inherited mid-use): leave it to finish on its own and compile here."""
        log.warning("%s: chunk 0's compile in a forked child ran past %.0f s; compiling it in this process",
                    self.name, WAIT_LIMIT_S)
        if self.child is not None:
            self.child.detach()  # reaped when it ends; a kill could leave its compiler's files half-written
            self.child = None
        self._finish()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the forked child's compile, at most `timeout` seconds, then take it here;
        whether chunk 0's compile is over."""
        import time
        end = None if timeout is None else time.monotonic() + timeout
        while self._child_running() and (end is None or time.monotonic() < end):
            time.sleep(0.2)
        if self.job is not None and not self._child_running():
            self._finish()
        return self.job is None


def _cache_on() -> bool:
    from torch._inductor import config as inductor_config
    return bool(inductor_config.fx_graph_cache) and not inductor_config.force_disable_caches


# Under auto, a busy machine (no core free for the child) is looked at again after this long
RECHECK_S = 30.0

# Mode "wait": the longest a step waits for the child's compile before compiling here (a
# whole compile of the bench preset's chunk program took about 50 s on the 2-core machine)
WAIT_LIMIT_S = 600.0

# A forked compile still running this long ends itself (SIGALRM)
CHILD_LIMIT_S = 7200


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
