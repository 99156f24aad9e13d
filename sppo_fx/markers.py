"""`sppo_fx.split_point(x)`: mark a pipeline-stage boundary inside a model.

    h = block(h)
    h = sppo_fx.split_point(h)      # stages split here when compiled with stages > 1
    h = next_block(h)

It is an identity (a copy in eager mode) recorded by torch.export as
`torch.ops.sppo_fx.split_point.default`; the stage-split pass cuts the graph after it and
removes it.
"""
from __future__ import annotations

import torch


@torch.library.custom_op("sppo_fx::split_point", mutates_args=())
def _split_point(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_split_point.register_fake
def _(x):
    return torch.empty_like(x)


def _backward(ctx, grad):
    return grad


_split_point.register_autograd(_backward)

SPLIT_POINT = torch.ops.sppo_fx.split_point.default


def split_point(x: torch.Tensor) -> torch.Tensor:
    """Mark a pipeline-stage boundary after `x` (returns `x`'s value).

    Args:
        x: the activation that crosses the boundary.

    Returns:
        A tensor equal to `x`.
    """
    return _split_point(x)
