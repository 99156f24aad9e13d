"""Compile a chunk program with Inductor, counting (re)compilations.

The chunk program is compiled once per distinct guard set, with dynamic shapes so the
prefix length and the chunk length stay symbolic: a sequence of N chunks compiles a small,
bounded number of times (typically one graph for chunk 0, whose prefix is empty, and one
for every later chunk), forward and backward (AOTAutograd). Every compile goes through
`_counting_backend`, which records it, and the generated Python/C++/Triton modules are
listed by `CompiledProgram.generated_code()`.

Across processes, Inductor's caches (in `TORCHINDUCTOR_CACHE_DIR`) serve a program compiled
before: the FX graph cache (forward and backward graphs after the memory passes) and the
AOTAutograd cache (the whole trace, partition and compile, keyed on Dynamo's graph). The
AOTAutograd cache key holds the memory partitioner's `uuid()`: its policy and a digest of
sppo_fx's sources (`sppo_fx/util/disk_cache.py`), so an entry made by other memory passes is
never reused. On CPU the chunk attention is an autograd.Function (`sppo_fx/chunk_attention/functions.py`), which Dynamo traces into
the graph (forward and backward bodies, both in the key); torch refuses such graphs for the
AOTAutograd cache unless told they are safe, which ours are: the bodies are all it does.
On a hit no partition runs, so `CompiledProgram.partitions` has no record of that compile.

On CPU, a forked child compiles the backward graph into the FX graph cache while this process
compiles the forward graph (`sppo_fx/codegen/split_compile.py`).
"""
from __future__ import annotations

import dataclasses
import functools
import threading

import torch
import torch.fx as fx

from sppo_fx.codegen.background import ExactSizeGraphs, with_constants
from sppo_fx.util.disk_cache import source_digest
from sppo_fx.util.log import get_logger, phase

log = get_logger(__name__)


@dataclasses.dataclass
class CodegenStats:
    """What Inductor did for one compiled program.

    Attributes:
        compiles: graphs compiled through Dynamo (1 + recompiles).
        graph_inputs: for each of those, the example input shapes it saw (ints for scalars).
        exact_traces: chunk 0's programs traced at its exact sizes (`CompiledProgram._trace_exact`).
        backward_in_child: compiles whose backward graph a forked child compiled into
            Inductor's cache, where this process then found it (`sppo_fx/codegen/split_compile.py`).
        background_compiles: chunk 0's exact-size programs that Inductor compiled on a
            background thread (`sppo_fx/codegen/background.py`); not in `compiles`.
        background_failures: such compiles that failed (chunk 0 kept its op-by-op graphs).
        exact_eager_calls: calls of chunk 0's exact-size programs that ran AOTAutograd's
            graphs op by op.
        exact_compiled_calls: calls of them that ran Inductor's code (compiled in the background).
        background_compile_rss_bytes: what this process's RSS grew by while it took chunk 0's
            compiled program (from Inductor's cache, or compiled here where no child could),
            read after Python's garbage and glibc's free heap were given back (Linux; 0
            elsewhere): the program's code and AOTAutograd's and Inductor's state for it.
            On a CPU the step that takes it measures that on top of its tensors (the demo
            tells them apart).
    """

    compiles: int = 0
    graph_inputs: list = dataclasses.field(default_factory=list)
    exact_traces: int = 0
    backward_in_child: int = 0
    background_compiles: int = 0
    background_failures: int = 0
    exact_eager_calls: int = 0
    exact_compiled_calls: int = 0
    background_compile_rss_bytes: int = 0


# Chunk-0 sizes traced exactly (no Dynamo) before chunk 0 gets one dynamic-shape program:
# a fixed sequence length has one chunk-0 size (traced once for training and once for
# no_grad); a length that varies would otherwise trace at every new size.
EXACT_SIZES = 2


def _code_modules():
    from torch._inductor.codecache import PyCodeCache
    return PyCodeCache.modules


@functools.cache
def _partitioner_class():
    """Inductor's `custom_partitioner_fn` hook type, made on first use (importing sppo_fx
    does not import Inductor). Inductor pickles its config into cache keys, so the class is
    published in this module and instances pickle as their policy."""
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class SppoMemoryPartitioner(CustomPartitionerFn):
        def __init__(self, recompute: str, offload: bool, records: list | None = None, grad_index=None,
                     split=None):
            from sppo_fx.passes.offload import memory_partitioner
            self.recompute, self.offload, self.split = recompute, offload, split
            self.fn = memory_partitioner(recompute, offload, records, grad_index)

        def __call__(self, gm, joint_inputs, **kw):
            # the joint graph is traced: the progress lines split the compile into the
            # trace (before this line), the partition and the two graphs' compiles
            log.info("joint graph traced: %d nodes", len(gm.graph.nodes))
            with phase("memory passes: partitioning the joint graph", log):
                graphs = self.fn(gm, joint_inputs, **kw)
            if self.split is not None:  # the backward graph compiles in a forked child
                self.split.fork(graphs[1])
                if self.split.child.pid is not None and not self.split.in_child:
                    log.info("the backward graph (%d nodes) compiles in forked process %d",
                             len(graphs[1].graph.nodes), self.split.child.pid)
            return graphs

        def __reduce__(self):
            return _make_partitioner, (self.recompute, self.offload)

        def uuid(self):
            # the cache keys' word for what this partitioner does (the records list only
            # collects what it did)
            return f"sppo_fx.memory_partitioner:{self.recompute}:{self.offload}:{source_digest()}"

    SppoMemoryPartitioner.__module__ = __name__
    globals()["SppoMemoryPartitioner"] = SppoMemoryPartitioner
    return SppoMemoryPartitioner


def _make_partitioner(recompute: str, offload: bool):
    return _partitioner_class()(recompute, offload)


def _inner_compile(what: str, offload: bool, split=None):
    """Inductor's inner compile of one program's forward and backward graphs. The backward
    graph gets a phase of its own (`what` + " backward"): where it is compiled lazily, at the
    first backward, that is outside the compile phase that Dynamo's backend call opened, and
    the progress lines and `log.record_phases` still show it. With `offload`, the forward graph's
    buffers handed to the runtime are kept from reuse (`_forward_holding_handed_out`). With `split` (a
    `BackwardInChild`), a forked child compiles the backward graph while this process
    compiles the forward graph (`sppo_fx/codegen/split_compile.py`)."""
    from torch._inductor.compile_fx import compile_fx_inner

    def inner(gm, example_inputs, **kwargs):
        if kwargs.get("is_backward"):
            with phase(f"{what} backward ({len(gm.graph.nodes)} nodes)", log):
                if split is not None:
                    return split.compile_backward(lambda: compile_fx_inner(gm, example_inputs, **kwargs))
                return compile_fx_inner(gm, example_inputs, **kwargs)
        if split is not None and split.in_child:
            return split.forward_stub(gm)
        with phase(f"{what} forward ({len(gm.graph.nodes)} nodes)", log):
            if offload:
                return _forward_holding_handed_out(gm, example_inputs, **kwargs)
            return compile_fx_inner(gm, example_inputs, **kwargs)
    return inner


def _forward_holding_handed_out(gm, example_inputs, **kwargs):
    """Inductor's inner compile of a forward graph with offload nodes.

    A tensor handed to `sppo.offload` (or `sppo.kv_out`) stays referenced by the runtime
    after the graph's last use of it (until its copy is written, or to the backward when
    the slot is kept): Inductor must not recycle its buffer for another tensor or write a
    kernel's output into it in place. Those buffers, and only those, are kept from reuse
    (`sppo_fx/codegen/held_buffers.py`: `never_reuse_buffers` for the lowering's
    reuse and in-place updates, and the calls moved past any later op Inductor's FX
    reinplacing could write into their input); the rest of the graph keeps Inductor's buffer
    reuse, as the backward graph does (its ops keep nothing they are given). On a CPU
    every fresh buffer costs page faults: with reuse off in the whole forward graph, as
    before, the demo's plan ran 0.945 s a step against 0.901 s (the two interleaved in one
    process, docs/solver-clock.md).
    """
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner
    from sppo_fx.codegen.held_buffers import deferred_holds, hold_handed_out_tensors
    hold_handed_out_tensors()
    # memory planning (inference graphs) pools buffers by live range, where a held buffer's
    # ends at its allocation
    with inductor_config.patch(memory_planning=False,
                               post_grad_custom_post_pass=deferred_holds(inductor_config.post_grad_custom_post_pass)):
        return compile_fx_inner(gm, example_inputs, **kwargs)


_cpu_probe: threading.Thread | None = None


def start_cpu_probe() -> None:
    """Start Inductor's one-time CPU probe on a background thread, once per process.

    Inductor's first C++ kernel asks which vector ISAs the CPU runs: it builds a test
    library per ISA and loads each in a fresh Python process (`cpu_vec_isa.valid_vec_isa_list`,
    cached for the process); 25 s of the bench model's first call on the 2-core test
    machine, idle in subprocesses. Started when a first call begins (with a budget: once
    the memory model is known, whose two traces take both cores), it overlaps capture, the
    solver and chunk 0's trace instead. The modules it uses are imported here, on the
    caller's thread, so the two threads never import at once; a failure is left for the
    compile to meet (it calls the same function)."""
    global _cpu_probe
    if _cpu_probe is not None:
        return
    import torch.utils._filelock  # noqa: F401  (check_build's lock)
    from torch._inductor import codecache, cpp_builder, cpu_vec_isa  # noqa: F401

    def probe():
        try:
            cpu_vec_isa.valid_vec_isa_list()
        except Exception:  # noqa: BLE001 - the compile calls it again and reports
            log.debug("Inductor's CPU probe failed on the background thread", exc_info=True)

    _cpu_probe = threading.Thread(target=probe, name="sppo_fx-inductor-cpu-probe", daemon=True)
    _cpu_probe.start()


def _join_cpu_probe(timeout_s: float = 60.0) -> bool:
    """Wait for the CPU probe's thread, at most `timeout_s`; whether it has ended (before a
    fork: the child must not inherit its locks mid-use; the compile needs its answer anyway)."""
    if _cpu_probe is not None:
        _cpu_probe.join(timeout_s)
        return not _cpu_probe.is_alive()
    return True


class CompiledProgram:
    """A GraphModule compiled on first call (dynamic shapes); callable like the module.

    Args:
        gm: the program to compile.
        name: a label for messages.
        dynamic: compile with dynamic shapes (prefix and chunk lengths symbolic).
        backend: "inductor" (C++/Triton code) or "eager" (AOTAutograd's forward and backward
            graphs run op by op: the same graphs, no codegen).
        offload: partition with the memory passes (`sppo_fx.passes.offload`): saved
            activations go through offload/wait nodes that the executor's
            `ChunkMemory` serves.
        recompute: recompute policy of the memory passes ("none", "cheap", "full").
        eager_empty_prefix: with backend "inductor", chunk 0 (`chunk_start` 0, an empty
            K/V prefix) runs AOTAutograd's graphs of the same program op by op instead of
            compiling a second Inductor graph for it: dynamic shapes specialise a size (or an
            int) of 0, so chunk 0 would otherwise cost a whole extra Inductor compile (about
            half of the first call's compile time) for 1/N of the step's work. Those graphs
            are traced at chunk 0's exact sizes without Dynamo (`_trace_exact`). Chunk 0 is
            told by its `chunk_start` placeholder being 0 (a streamed skeleton's prefix
            handles are empty tensors for every chunk), or, in a program without one, by an
            empty tensor argument. Same partition, same memory passes; the results differ
            from Inductor's only by floating-point reassociation. From chunk 0's second call
            on, Inductor compiles those exact-size programs (a forked child beside the
            steps, or that call waits for the compile: `sppo_fx/codegen/background.py`,
            `SPPO_FX_BACKGROUND_COMPILE`), and chunk 0 runs Inductor's code once it is
            ready, so the steady step is compiled throughout.

    Attributes:
        partitions: one `PartitionRecord` (forward graph, backward graph, offload slots)
            per compile, when the memory passes ran (not on an AOTAutograd cache hit).
    """

    def __init__(self, gm: fx.GraphModule, name: str = "chunk", dynamic: bool = True, *,
                 backend: str = "inductor", offload: bool = False, recompute: str = "none",
                 eager_empty_prefix: bool = True):
        from sppo_fx.passes.offload import RECOMPUTE_POLICIES
        if backend not in ("inductor", "eager"):
            raise ValueError(f"backend {backend!r}: choose 'inductor' or 'eager'")
        if recompute not in RECOMPUTE_POLICIES:
            from sppo_fx.errors import SppoError
            raise SppoError(f"recompute={recompute!r}: choose one of {RECOMPUTE_POLICIES}")
        # Its own GraphModule (sharing the graph): its own generated `forward` code object,
        # so Dynamo's per-code cache (and recompile limit) is this program's alone.
        gm = fx.GraphModule(gm, gm.graph, class_name=type(gm).__name__)
        self.gm, self.name, self.backend = gm, name, backend
        self.offload, self.recompute = offload, recompute
        self.partitions: list = []
        self.stats = CodegenStats()
        self._first_module = len(_code_modules())
        self._fn = torch.compile(gm, backend=self._counting_backend, dynamic=dynamic, fullgraph=True)
        self._dynamic = dynamic
        self._route_empty = backend == "inductor" and eager_empty_prefix
        self._empty_fn = None  # compiled on the first call of chunk 0
        self._exact: list = []  # chunk 0's exact-size programs (`background.ExactProgram`)
        self._what = f"compiling {name} program"
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        self._start_index = names.index("chunk_start") if "chunk_start" in names else None
        self._dynamic_dims = _dynamic_dims(gm) if dynamic else None

    def _empty_input_fn(self):
        if self._empty_fn is None:
            self._empty_fn = ExactSizeGraphs(self._trace_exact, EXACT_SIZES, self._dynamic_empty_input_fn)
        return self._empty_fn

    def _dynamic_empty_input_fn(self):
        """Chunk 0 once it has come in more than `EXACT_SIZES` sizes (sequence lengths that
        vary from step to step): one program for every size, Dynamo with dynamic shapes."""
        # its own GraphModule again: its own code object, so the two compiled wrappers
        # never share Dynamo's cache entries
        gm = fx.GraphModule(self.gm, self.gm.graph, class_name=type(self.gm).__name__)
        backend = functools.partial(self._counting_backend, backend="eager", first_chunk=True)
        return torch.compile(gm, backend=backend, dynamic=self._dynamic, fullgraph=True)

    def _trace_exact(self, args):
        """Chunk 0's forward and backward graphs, traced by AOTAutograd at these arguments'
        exact sizes, without Dynamo: the program is already one flat FX graph, and chunk 0
        has one set of sizes per chunk partition, so neither Dynamo's bytecode tracing nor
        symbolic shapes buy anything here (`ExactSizeGraphs` traces again for other sizes).
        Same memory passes as every compile. AOTAutograd traces on the first call, so the
        phase also runs chunk 0's forward."""
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_function
        from sppo_fx.passes.offload import over_tensor_args
        names = [n.name for n in self.gm.graph.nodes if n.op == "placeholder"]
        slots, program = over_tensor_args(self.gm, args)
        grad_index = {k: i for k, i in enumerate(slots) if names[i].startswith("p_")}

        def keep(g, _inputs):
            return make_boxed_func(views_as_reshapes(g).forward)

        self.stats.exact_traces += 1
        what = (f"tracing {self.name} program for chunk 0 (empty K/V prefix), size #{self.stats.exact_traces} "
                f"(AOTAutograd graphs at its sizes, no Dynamo, no Inductor; recompute {self.recompute}"
                f"{', offload' if self.offload else ''}) and running its forward")
        compiled = aot_function(program, fw_compiler=keep, bw_compiler=keep,
                                partition_fn=self._partition_fn(grad_index))
        first = [True]

        def run(*tensors):
            if first[0]:
                first[0] = False
                from torch._dynamo.convert_frame import compile_lock
                with compile_lock, phase(what, log):  # not while a background compile runs
                    return compiled(*tensors)
            return compiled(*tensors)
        from sppo_fx.codegen import background
        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        later, mode = None, background.mode(device) if self.backend == "inductor" else "off"
        if mode != "off":
            later = functools.partial(self._compile_exact_later, with_constants(self.gm, args), grad_index)
        program_ = background.ExactProgram(run, later, self.stats, f"{self.name} program", device,
                                           wait=mode == "wait")
        self._exact.append(program_)
        return program_

    def _compile_exact_later(self, program: fx.GraphModule, grad_index: dict, tensors) -> object:
        """What the background thread runs for chunk 0's exact-size `program`
        (`background.ExactProgram`): Inductor with the same memory passes, at these tensors'
        sizes (static shapes), the forward and backward graphs at once. Fake inputs are made
        here, on the caller's thread."""
        from sppo_fx.codegen.background import fake_copies
        fakes = fake_copies(tensors)
        what = (f"compiling {self.name} program for chunk 0 at its sizes in the background (Inductor; "
                f"recompute {self.recompute}{', offload' if self.offload else ''})")

        compile_ = self._compile  # the compiler of now, not of when the thread runs

        def job():
            from torch._functorch import config as functorch_config
            with functorch_config.patch(force_non_lazy_backward_lowering=True), phase(what, log):
                return compile_(program, fakes, "inductor", grad_index=grad_index, what=what)
        return job

    def wait_background(self, timeout: float | None = None) -> bool:
        """Wait for chunk 0's compiles under way (`sppo_fx/codegen/background.py`), at most
        `timeout` seconds each, and take them; whether none is left. A benchmark that times
        steady steps calls it after its second step."""
        return all([p.wait(timeout) for p in self._exact])

    def compile_under_way(self) -> bool:
        """Whether a chunk-0 compile runs beside the steps now (a forked child's), without
        taking or starting anything (`wait_background` does)."""
        return any(p.running() for p in self._exact)

    def _partition_fn(self, grad_index):
        from sppo_fx.passes.offload import memory_partitioner
        return memory_partitioner(self.recompute, self.offload, self.partitions, grad_index)

    def _grad_index(self, graph: fx.GraphModule) -> dict[int, int]:
        """Dynamo's graph input k -> index of the program's parameter placeholder it is.

        Dynamo names the input for argument `x` `l_x_`; exported parameters are `p_*`."""
        names = [n.name for n in self.gm.graph.nodes if n.op == "placeholder"]
        index = {f"l_{name}_": i for i, name in enumerate(names) if name.startswith("p_")}
        inputs = [n.name for n in graph.graph.nodes if n.op == "placeholder"]
        return {k: index[name] for k, name in enumerate(inputs) if name in index}

    def _counting_backend(self, graph: fx.GraphModule, example_inputs, backend: str | None = None,
                          first_chunk: bool = False):
        backend = backend or self.backend
        self.stats.compiles += 1
        what = (f"compiling {self.name} program #{self.stats.compiles}"
                f"{' (chunk 0, empty K/V prefix, any size)' if first_chunk else ''} "
                f"({'Inductor' if backend == 'inductor' else 'AOTAutograd graphs, no Inductor'}; "
                f"recompute {self.recompute}{', offload' if self.offload else ''})")
        self._what = what  # the backward's phase is named after it (`_inner_compile`)
        self.stats.graph_inputs.append([tuple(t.shape) if isinstance(t, torch.Tensor) else t
                                        for t in example_inputs])
        with phase(what, log):
            return self._compile(graph, example_inputs, backend)

    def _compile(self, graph: fx.GraphModule, example_inputs, backend: str, grad_index: dict | None = None,
                 what: str | None = None):
        """Compile Dynamo's `graph` (or, with `grad_index`, chunk 0's flat program on the
        background thread: its parameter indices given, never split into a forked child)."""
        background = grad_index is not None
        if grad_index is None:
            grad_index = self._grad_index(graph)
        what = what or self._what
        if backend == "eager":
            from functorch.compile import make_boxed_func
            from torch._dynamo.backends.common import aot_autograd

            def keep(g, _inputs):
                return make_boxed_func(views_as_reshapes(g).forward)
            return aot_autograd(fw_compiler=keep, bw_compiler=keep,
                                partition_fn=self._partition_fn(grad_index))(graph, example_inputs)
        from torch._inductor.compile_fx import compile_fx
        from sppo_fx.codegen import split_compile
        split = None
        if not background and self._dynamic and torch.is_grad_enabled() and split_compile.eligible(example_inputs):
            split = split_compile.BackwardInChild(what, before_fork=_join_cpu_probe)
        patches = {"custom_partitioner_fn": _partitioner_class()(self.recompute, self.offload, self.partitions,
                                                                 grad_index, split)}
        from torch._functorch import config as functorch_config
        try:
            # the CPU chunk attention's autograd.Function may be cached (module docstring)
            with functorch_config.patch(autograd_cache_allow_custom_autograd_functions=True):
                return compile_fx(graph, example_inputs, config_patches=patches,
                                  inner_compile=_inner_compile(what, self.offload, split))
        finally:
            if split is not None:
                split.leave()  # the child never returns from here
                self.stats.backward_in_child += split.from_child

    def __call__(self, *args):
        # Without duck shaping, a prefix as long as the chunk does not get the chunk's
        # symbol (which would force a recompile at the next chunk).
        # Chunks of 1 token and the empty prefix of chunk 0 specialise: allow a few graphs.
        with torch.fx.experimental._config.patch(use_duck_shape=False), \
                torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, 16)):
            if self._dynamic_dims is not None:
                _mark_static(args, self._dynamic_dims)
            if self._route_empty and self._is_first_chunk(args):
                return self._empty_input_fn()(*args)
            return self._fn(*args)

    def _is_first_chunk(self, args) -> bool:
        """Chunk 0: `chunk_start` is 0 (or, without that placeholder, a tensor is empty)."""
        if self._start_index is not None and self._start_index < len(args):
            start = args[self._start_index]
            return not isinstance(start, torch.Tensor) and int(start) == 0
        return any(isinstance(a, torch.Tensor) and a.numel() == 0 for a in args)

    def graphs(self) -> dict[str, fx.GraphModule]:
        """The forward and backward graphs of each compile (memory passes only):
        {"forward.0": ..., "backward.0": ..., "forward.1": ...}."""
        out = {}
        for k, rec in enumerate(self.partitions):
            out[f"forward.{k}"], out[f"backward.{k}"] = rec.forward, rec.backward
        return out

    def generated_code(self) -> list[str]:
        """Paths of the Python modules Inductor generated since this program was created
        (forward and backward kernels' wrappers; the C++/Triton sources they load sit next to
        them in Inductor's cache directory)."""
        return [m.__file__ for m in _code_modules()[self._first_module:] if getattr(m, "__file__", None)]


def _dynamic_dims(gm: fx.GraphModule) -> list[tuple[int, ...] | None]:
    """Per placeholder, its sequence (chunk or prefix length) dims: what stays symbolic.
    Sequence-dim inputs carry their symbolic shape from the capture (`meta["val"]`, a SymInt
    at the sequence dim; parameters and buffers have none), K/V prefixes their sequence dim
    (`meta["seq_dim"]`, set by the chunk pass); None where neither is recorded (Dynamo decides)."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            out.append(tuple(d for d, s in enumerate(val.shape) if isinstance(s, torch.SymInt)))
        elif isinstance(node.meta.get("seq_dim"), int):
            out.append((node.meta["seq_dim"],))
        else:
            out.append(None)
    return out


def _mark_static(args, dynamic_dims) -> None:
    """Mark every dim but the sequence dims static for Dynamo: batch, heads, head and model
    dims become constants rather than symbols (the exported program has them static anyway),
    which leaves fewer symbols and guards to trace, partition and generate code for."""
    for arg, dynamic in zip(args, dynamic_dims):
        if dynamic is None or not isinstance(arg, torch.Tensor):
            continue
        for d in range(arg.dim()):
            if d not in dynamic:
                torch._dynamo.mark_static(arg, d)


def views_as_reshapes(g: fx.GraphModule) -> fx.GraphModule:
    """AOTAutograd's graph, run op by op, with every `view` a `reshape` (a view wherever one
    is possible, a copy otherwise). Its graphs are traced on meta kernels, whose output
    strides may differ from the eager kernels' at run time: `_log_softmax_backward_data` of
    a transposed soft target came out strided, and the next `view` raised (fuzzer seed 12).
    Inductor's own kernels honour the traced strides; this is for the graphs it never sees."""
    for node in g.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
    g.recompile()
    return g


def compile_chunk_program(gm: fx.GraphModule, *, backend: str = "inductor", offload: bool = False,
                          recompute: str = "none", eager_empty_prefix: bool = True) -> CompiledProgram:
    """Compile the per-chunk program (dynamic shapes, full graph).

    Args:
        gm: the chunk program.
        backend: "inductor" or "eager" (see `CompiledProgram`).
        offload: insert offload/wait nodes for saved activations.
        recompute: recompute policy ("none", "cheap", "full").
        eager_empty_prefix: run chunk 0 (empty K/V prefix) without Inductor (see
            `CompiledProgram`); False when chunk 0 is the whole sequence.

    Returns:
        The `CompiledProgram`.
    """
    return CompiledProgram(gm, "chunk", backend=backend, offload=offload, recompute=recompute,
                           eager_empty_prefix=eager_empty_prefix)
