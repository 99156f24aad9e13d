"""Small shims over torch internals whose names or behaviour differ between releases.

Each helper detects the feature it needs (never the version string) and behaves as the
newest supported torch does.
"""
from __future__ import annotations

import contextlib

import torch


def optimization_hint(x) -> int:
    """The example value of an int or SymInt, without adding a guard.

    `torch.fx.experimental.symbolic_shapes.optimization_hint` where torch has it (newer
    releases); `size_hint`, its older name, otherwise."""
    if not isinstance(x, torch.SymInt):
        return int(x)
    from torch.fx.experimental import symbolic_shapes
    hint = getattr(symbolic_shapes, "optimization_hint", None)
    if hint is None:
        hint = symbolic_shapes.size_hint
    return hint(x)


def symbolic_dispatch():
    """Context for running ATen ops on fake tensors with SymInt sizes outside of a tracer.

    Some composite kernels (e.g. `aten.linear`/`aten.matmul` on a 3-d input in torch 2.11)
    read `numel()` in C++, which fails on symbolic sizes; the Python dispatcher routes them
    to their SymInt-aware Python decompositions, as torch.export and make_fx do."""
    try:
        from torch._dispatch.python import enable_python_dispatcher
    except ImportError:  # pragma: no cover - present in every supported torch
        return contextlib.nullcontext()
    return enable_python_dispatcher()


def flash_attention_ops():
    """(forward, backward) of ATen's CUDA flash attention, the pair that returns and takes
    the log-sum-exp, or None where this torch lacks either."""
    aten = torch.ops.aten
    if not (hasattr(aten, "_scaled_dot_product_flash_attention")
            and hasattr(aten, "_scaled_dot_product_flash_attention_backward")):
        return None  # pragma: no cover - present in every supported torch
    return aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward


def flash_sdp_enabled() -> bool:
    """Whether the user left torch's flash SDPA backend on (torch.backends.cuda)."""
    check = getattr(torch.backends.cuda, "flash_sdp_enabled", None)
    return True if check is None else bool(check())


_CAPABILITY: dict = {}


def cuda_capability(device):
    """(major, minor) of a CUDA device, cached per device index; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index not in _CAPABILITY:
        _CAPABILITY[index] = tuple(torch.cuda.get_device_capability(index))
    return _CAPABILITY[index]
