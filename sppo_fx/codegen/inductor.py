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
sppo_fx's sources (`sppo_fx/disk_cache.py`), so an entry made by other memory passes is
never reused. On CPU the chunk attention is an autograd.Function (`sppo_fx/attention.py`), which Dynamo traces into
the graph (forward and backward bodies, both in the key); torch refuses such graphs for the
AOTAutograd cache unless told they are safe, which ours are: the bodies are all it does.
On a hit no partition runs, so `CompiledProgram.partitions` has no record of that compile.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.fx as fx

from sppo_fx.disk_cache import source_digest
from sppo_fx.log import get_logger, phase

log = get_logger(__name__)


@dataclasses.dataclass
class CodegenStats:
    """What Inductor did for one compiled program.

    Attributes:
        compiles: graphs compiled (1 + recompiles).
        graph_inputs: for each compile, the example input shapes it saw (ints for scalars).
    """

    compiles: int = 0
    graph_inputs: list = dataclasses.field(default_factory=list)


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
        def __init__(self, recompute: str, offload: bool, records: list | None = None, grad_index=None):
            from sppo_fx.passes.offload import memory_partitioner
            self.recompute, self.offload = recompute, offload
            self.fn = memory_partitioner(recompute, offload, records, grad_index)

        def __call__(self, gm, joint_inputs, **kw):
            return self.fn(gm, joint_inputs, **kw)

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


def _inner_compile(what: str, offload: bool):
    """Inductor's inner compile of one program's forward and backward graphs. The backward
    graph is compiled lazily, at the first backward, outside the compile phase that Dynamo's
    backend call opened: it gets a phase of its own (`what` + " backward"), so the progress
    lines and `log.record_phases` show it. With `offload`, buffer reuse is off in the
    forward graph (`_forward_without_buffer_reuse`)."""
    from torch._inductor.compile_fx import compile_fx_inner

    def inner(gm, example_inputs, **kwargs):
        if kwargs.get("is_backward"):
            with phase(f"{what} backward", log):
                return compile_fx_inner(gm, example_inputs, **kwargs)
        if offload:
            return _forward_without_buffer_reuse(gm, example_inputs, **kwargs)
        return compile_fx_inner(gm, example_inputs, **kwargs)
    return inner


def _forward_without_buffer_reuse(gm, example_inputs, **kwargs):
    """Inductor's inner compile, with buffer reuse off in forward graphs only.

    A tensor handed to `sppo.offload` (or `sppo.kv_out`) in a forward graph stays
    referenced by the activation store after the graph's last use of it (until its copy is
    written, or to the backward when the slot is kept): Inductor must not recycle its buffer
    for another tensor or write a kernel's output into it in place. The backward graph's ops
    keep nothing they are given (`sppo.wait` hands tensors to the graph,
    `sppo.accumulate_grad` copies or adds, the prefix attention's K/V gradients are its
    own), so the backward keeps Inductor's buffer reuse: on a CPU every fresh buffer costs
    page faults (bench model, 4096 tokens, 25% budget, under bench/memory.py's malloc
    settings: 14.2 GiB faulted in per step with reuse off in both graphs, 10.7 GiB with it
    on in backward; 4 chunks without offload: 6.4 GiB).
    """
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner
    if kwargs.get("is_backward"):
        return compile_fx_inner(gm, example_inputs, **kwargs)
    with inductor_config.patch(allow_buffer_reuse=False, inplace_buffers=False):
        return compile_fx_inner(gm, example_inputs, **kwargs)


class CompiledProgram:
    """A GraphModule compiled on first call (dynamic shapes); callable like the module.

    Args:
        gm: the program to compile.
        name: a label for messages.
        dynamic: compile with dynamic shapes (prefix and chunk lengths symbolic).
        backend: "inductor" (C++/Triton code) or "eager" (AOTAutograd's forward and backward
            graphs run op by op: the same graphs, no codegen).
        offload: partition with the memory passes (`sppo_fx.passes.offload`): saved
            activations go through offload/prefetch/wait nodes that the executor's
            `ChunkMemory` serves.
        recompute: recompute policy of the memory passes ("none", "cheap", "full").
        eager_empty_prefix: with backend "inductor", chunk 0 (`chunk_start` 0, an empty
            K/V prefix) runs AOTAutograd's graphs of the same program op by op instead of
            compiling a second Inductor graph for it: dynamic shapes specialise a size (or an
            int) of 0, so chunk 0 would otherwise cost a whole extra Inductor compile (about
            half of the first call's compile time) for 1/N of the step's work. Chunk 0 is
            told by its `chunk_start` placeholder being 0 (a streamed skeleton's prefix
            handles are empty tensors for every chunk), or, in a program without one, by an
            empty tensor argument. Same partition, same memory passes; the results differ
            from Inductor's only by floating-point reassociation.

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
        self._what = f"compiling {name} program"
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        self._start_index = names.index("chunk_start") if "chunk_start" in names else None

    def _empty_input_fn(self):
        if self._empty_fn is None:
            # its own GraphModule again: its own code object, so the two compiled wrappers
            # never share Dynamo's cache entries
            gm = fx.GraphModule(self.gm, self.gm.graph, class_name=type(self.gm).__name__)
            backend = functools.partial(self._counting_backend, backend="eager", first_chunk=True)
            self._empty_fn = torch.compile(gm, backend=backend, dynamic=self._dynamic, fullgraph=True)
        return self._empty_fn

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
                f"{' (chunk 0, empty K/V prefix)' if first_chunk else ''} "
                f"({'Inductor' if backend == 'inductor' else 'AOTAutograd graphs, no Inductor'}; "
                f"recompute {self.recompute}{', offload' if self.offload else ''})")
        self._what = what  # the backward's phase is named after it (`_inner_compile`)
        with phase(what, log):
            return self._compile(graph, example_inputs, backend)

    def _compile(self, graph: fx.GraphModule, example_inputs, backend: str):
        self.stats.graph_inputs.append([tuple(t.shape) if isinstance(t, torch.Tensor) else t
                                        for t in example_inputs])
        if backend == "eager":
            from functorch.compile import make_boxed_func
            from torch._dynamo.backends.common import aot_autograd

            def keep(g, _inputs):
                return make_boxed_func(g.forward)
            return aot_autograd(fw_compiler=keep, bw_compiler=keep,
                                partition_fn=self._partition_fn(self._grad_index(graph)))(graph, example_inputs)
        from torch._inductor.compile_fx import compile_fx
        patches = {"custom_partitioner_fn": _partitioner_class()(self.recompute, self.offload, self.partitions,
                                                                 self._grad_index(graph))}
        from torch._functorch import config as functorch_config
        # the CPU chunk attention's autograd.Function may be cached (module docstring)
        with functorch_config.patch(autograd_cache_allow_custom_autograd_functions=True):
            return compile_fx(graph, example_inputs, config_patches=patches,
                              inner_compile=_inner_compile(self._what, self.offload))

    def __call__(self, *args):
        # Without duck shaping, a prefix as long as the chunk does not get the chunk's
        # symbol (which would force a recompile at the next chunk).
        # Chunks of 1 token and the empty prefix of chunk 0 specialise: allow a few graphs.
        with torch.fx.experimental._config.patch(use_duck_shape=False), \
                torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, 16)):
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


def compile_chunk_program(gm: fx.GraphModule, *, backend: str = "inductor", offload: bool = False,
                          recompute: str = "none", eager_empty_prefix: bool = True) -> CompiledProgram:
    """Compile the per-chunk program (dynamic shapes, full graph).

    Args:
        gm: the chunk program.
        backend: "inductor" or "eager" (see `CompiledProgram`).
        offload: insert offload/prefetch/wait nodes for saved activations.
        recompute: recompute policy ("none", "cheap", "full").
        eager_empty_prefix: run chunk 0 (empty K/V prefix) without Inductor (see
            `CompiledProgram`); False when chunk 0 is the whole sequence.

    Returns:
        The `CompiledProgram`.
    """
    return CompiledProgram(gm, "chunk", backend=backend, offload=offload, recompute=recompute,
                           eager_empty_prefix=eager_empty_prefix)
