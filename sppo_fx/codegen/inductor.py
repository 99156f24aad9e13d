"""Compile a chunk program with Inductor, counting (re)compilations.

The chunk program is compiled once per distinct guard set, with dynamic shapes so the
prefix length and the chunk length stay symbolic: a sequence of N chunks compiles a small,
bounded number of times (typically one graph for chunk 0, whose prefix is empty, and one
for every later chunk), forward and backward (AOTAutograd). Every compile goes through
`_counting_backend`, which records it, and the generated Python/C++/Triton modules are
listed by `CompiledProgram.generated_code()`.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx


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


class CompiledProgram:
    """A GraphModule compiled by Inductor on first call; callable like the module.

    Args:
        gm: the program to compile.
        name: a label for messages.
        dynamic: compile with dynamic shapes (prefix and chunk lengths symbolic).
    """

    def __init__(self, gm: fx.GraphModule, name: str = "chunk", dynamic: bool = True):
        self.gm, self.name = gm, name
        self.stats = CodegenStats()
        self._first_module = len(_code_modules())
        self._fn = torch.compile(gm, backend=self._counting_backend, dynamic=dynamic, fullgraph=True)

    def _counting_backend(self, graph: fx.GraphModule, example_inputs):
        from torch._inductor.compile_fx import compile_fx
        self.stats.compiles += 1
        self.stats.graph_inputs.append([tuple(t.shape) if isinstance(t, torch.Tensor) else t
                                        for t in example_inputs])
        return compile_fx(graph, example_inputs)

    def __call__(self, *args):
        # Without duck shaping, a prefix as long as the chunk does not get the chunk's
        # symbol (which would force a recompile at the next chunk).
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            return self._fn(*args)

    def generated_code(self) -> list[str]:
        """Paths of the Python modules Inductor generated since this program was created
        (forward and backward kernels' wrappers; the C++/Triton sources they load sit next to
        them in Inductor's cache directory)."""
        return [m.__file__ for m in _code_modules()[self._first_module:] if getattr(m, "__file__", None)]


def compile_chunk_program(gm: fx.GraphModule) -> CompiledProgram:
    """Compile the per-chunk program with Inductor (dynamic shapes, full graph)."""
    return CompiledProgram(gm, "chunk")
