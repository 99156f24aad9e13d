"""Offload and wait: the operators the memory pass puts into a chunk program's AOT forward
and backward graphs (`sppo_fx.passes.offload`).

They are `torch.library` custom ops, so they survive Inductor as extern calls and show
in the generated code as `torch.ops.sppo.offload.default(...)` etc.

    forward                                   backward
      x = some_op(...)                          ...
      h = sppo.offload(x, slot)                 x  = sppo.wait(h, slot, dim_order)
      return ..., h       # saved: h, not x     ... x's users
                                                g  = <grad of parameter i>
                                                sppo.accumulate_grad(g, i)   # into .grad now
                                                sppo.accumulate_grad_mm(a, b, j)  # .grad += a @ b
                                                return (..., None, ...)      # not g

A handle is an *empty* tensor of shape (*x.shape, 0): it owns no memory, and carries x's
symbolic sizes, dtype and device from the forward graph into the backward graph. What
data belongs to a slot is runtime state: the `ChunkMemory` of the chunk being run (the
executor activates it around that chunk's forward and backward with `active_memory`)
decides keep | offload per slot and hands the tensor back at `wait`. Reads are requested
by the executor before the chunk's backward runs (`ChunkMemory.prefetch()`), not by the
graph.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple, Protocol

import torch

from sppo_fx.errors import SppoError


class SlotMemory(Protocol):
    """What the ops talk to at run time (implemented by `runtime.memory.ChunkMemory`)."""

    def offload(self, x: torch.Tensor, slot: int) -> None: ...
    def wait(self, slot: int) -> torch.Tensor: ...
    def accumulate_grad(self, grad: torch.Tensor, index: int) -> None: ...
    def accumulate_grad_mm(self, a: torch.Tensor, b: torch.Tensor, index: int) -> None: ...


class MatmulGrad(NamedTuple):
    """A parameter gradient not yet computed: `a @ b` (`sppo.accumulate_grad_mm`). The
    receiver adds it with one `addmm_` (the GEMM reads `.grad` as its C operand), or makes
    it the first `.grad` with one `mm`: no gradient-sized temporary, no separate add."""

    a: torch.Tensor
    b: torch.Tensor

    def materialize(self) -> torch.Tensor:
        return torch.mm(self.a, self.b)


_active: list[SlotMemory] = []


@contextlib.contextmanager
def active_memory(memory: SlotMemory | None):
    """Make `memory` the target of the offload/wait ops while the block runs
    (None: nothing changes).

    Process-wide (not thread-local): on CUDA the autograd engine runs backward graphs on
    its own device threads.
    """
    if memory is None:
        yield None
        return
    _active.append(memory)
    try:
        yield memory
    finally:
        _active.remove(memory)


def _memory(op: str) -> SlotMemory:
    if not _active:
        raise SppoError(f"sppo.{op} ran outside a chunk: a graph with offload nodes must be run by the "
                        "sppo_fx executor (StageRunner / chunked_loss), which tells it where activations go")
    return _active[-1]


def _handle_like(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape, 0))


def expected_strides(shape, dim_order) -> list:
    """Dense strides of `shape` laid out in `dim_order` (outermost dim first)."""
    strides = [0] * len(shape)
    acc = 1
    for d in reversed(dim_order):
        strides[d] = acc
        acc = acc * shape[d]
    return strides


@torch.library.custom_op("sppo::offload", mutates_args=())
def offload(x: torch.Tensor, slot: int) -> torch.Tensor:
    """Hand `x` (a saved activation) to the active chunk's memory; returns its handle."""
    _memory("offload").offload(x, slot)
    return _handle_like(x)


@offload.register_fake
def _(x, slot):
    return _handle_like(x)


@torch.library.custom_op("sppo::wait", mutates_args=())
def wait(handle: torch.Tensor, slot: int, dim_order: list[int]) -> torch.Tensor:
    """Block until the slot's data is back; returns it with the layout the graph expects."""
    t = _memory("wait").wait(slot)
    shape = handle.shape[:-1]
    if tuple(t.shape) != tuple(shape) or t.dtype != handle.dtype or t.device != handle.device:
        raise SppoError(f"sppo.wait slot {slot}: got {tuple(t.shape)} {t.dtype} on {t.device}, the graph "
                        f"expects {tuple(shape)} {handle.dtype} on {handle.device}")
    strides = expected_strides(shape, dim_order)
    if all(a == b or n == 1 for a, b, n in zip(t.stride(), strides, shape)):
        # same layout (strides of size-1 dims are arbitrary): no copy
        return t if t.stride() == tuple(strides) else t.as_strided(shape, strides, t.storage_offset())
    out = torch.empty_permuted(shape, dim_order, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


@wait.register_fake
def _(handle, slot, dim_order):
    return torch.empty_permuted(handle.shape[:-1], dim_order, dtype=handle.dtype, device=handle.device)


@torch.library.custom_op("sppo::accumulate_grad", mutates_args=())
def accumulate_grad(grad: torch.Tensor, index: int) -> None:
    """Add a parameter's gradient into its `.grad` as soon as the backward graph produces
    it (what eager's AccumulateGrad does), so a chunk's backward never holds a second full
    set of parameter gradients."""
    _memory("accumulate_grad").accumulate_grad(grad, index)


@accumulate_grad.register_fake
def _(grad, index):
    return None


@torch.library.custom_op("sppo::accumulate_grad_mm", mutates_args=())
def accumulate_grad_mm(a: torch.Tensor, b: torch.Tensor, index: int) -> None:
    """`sppo.accumulate_grad(a @ b, index)` without materialising `a @ b`: a linear layer's
    weight gradient goes straight into `.grad` (`MatmulGrad`), see
    `sppo_fx.passes.offload.fuse_grad_matmul`."""
    _memory("accumulate_grad_mm").accumulate_grad_mm(a, b, index)


@accumulate_grad_mm.register_fake
def _(a, b, index):
    return None


# No outputs: without this, dead-code elimination (FX's and Inductor's) would drop them.
torch.fx.node.has_side_effect(torch.ops.sppo.accumulate_grad.default)
torch.fx.node.has_side_effect(torch.ops.sppo.accumulate_grad_mm.default)
