"""A distributed step on a (pp, dp, sp) layout, given this rank's `RankProduct` (built by
sppo_fx/orchestrate/ranks.py): split the batch into micro-batches and this rank's
data-parallel share of each, start the executor of the product, run a step.
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from sppo_fx.capture import flatten_call
from sppo_fx.errors import SppoError
from sppo_fx.runtime.distributed import PipelineExecutor
from sppo_fx.runtime.mesh import ParallelMesh
from sppo_fx.runtime.product import RankProduct


def split_microbatches(args: tuple, kwargs: dict, target, count: int) -> list[tuple]:
    """Split every tensor whose dim 0 is the batch size into `count` micro-batches.

    Returns:
        [(args, kwargs, target)] per micro-batch.
    """
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs), target))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not tensors:
        raise SppoError("no input tensor to split into micro-batches")
    batch = tensors[0].shape[0]
    if batch % count:
        raise SppoError(f"the batch of {batch} sequences does not split into microbatches={count}; "
                        f"use a batch size divisible by {count}")
    size = batch // count
    out = []
    for m in range(count):
        part = [x[m * size:(m + 1) * size] if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch
                else x for x in leaves]
        out.append(pytree.tree_unflatten(part, spec))
    return out


def data_shares(microbatches: list[tuple], mesh: ParallelMesh) -> list[tuple]:
    """This rank's data-parallel share of every micro-batch: the union over dp ranks of
    their m-th shares is micro-batch m, so summed partials see the whole micro-batch."""
    D = mesh.layout.dp
    if D == 1:
        return microbatches
    if (batch := batch_size(microbatches[0])) % D:
        raise SppoError(f"each micro-batch has {batch} sequences, which do not split over data_parallel={D}; "
                        f"use a batch size divisible by microbatches x data_parallel")
    return [split_microbatches(a, k, t, D)[mesh.dp_rank] for a, k, t in microbatches]


def batch_size(microbatch: tuple) -> int:
    """Sequences in a micro-batch (dim 0 of its first tensor with a dim)."""
    leaves = pytree.tree_leaves(microbatch)
    return next(x.shape[0] for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0)


def start(product: RankProduct, mesh: ParallelMesh, store=None, timeout_s: float = 60.0) -> PipelineExecutor:
    """The executor that runs `product` on this rank (`store`: the ActivationStore of the
    offload tier, if any)."""
    return PipelineExecutor(product.program, product.params, product.plan, product.schedule, mesh, product.chunk_fn,
                            timeout_s, product.shared, store, product.offload)


def pipeline_step(executor: PipelineExecutor, microbatches: list[tuple]) -> torch.Tensor:
    """Run one step on this rank: returns the loss (on every rank)."""
    inputs = []
    for mb in microbatches:
        leaves, _spec, slots = flatten_call(*mb)
        inputs.append([leaves[i] for i in slots])
    return executor.step(inputs)
