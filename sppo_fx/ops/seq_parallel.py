"""The all-to-alls of Ulysses-style sequence parallelism, as `torch.library` ops.

`passes.sequence_parallel` puts them around every attention call of a chunk program
(docs/architecture.md, section 3b "Parallel layout and sequence parallelism"):

    q, k, v  [b, heads, tokens of this rank, d]
      -> sppo.seq_to_heads     [b, heads / S, tokens of the whole chunk, d]
      -> prefix attention over this rank's heads of the K/V prefix
      -> sppo.heads_to_seq     [b, heads, tokens of this rank, d]

Each op's backward is the other one (an all-to-all is a permutation of blocks, so its
gradient is the inverse permutation). Heads travel in contiguous blocks of heads / S, so
rank j holds heads [j·H/S, (j+1)·H/S) and grouped-query groups stay whole.

Collectives pair up by their order on each rank, and nothing else: if rank 0 sends its dq
while rank 1 sends its dk (same sizes), the exchange mixes them with no error. A graph does
not fix the order of independent nodes (q, k and v's all-to-alls, and their gradients'),
and a compiler may pick any order, differently on each rank (Inductor did: HF Llama's q/k/v
gradients came back swapped, issue 26). So every op takes the token of the collective
before it (`after`) and returns its own: the pass chains a program's collectives through
them, and the backward chains the gradients' all-to-alls through the tokens' gradients, in
reverse. The order is then data, the same on every rank under any schedule.

The ranks of a chunk may hold different numbers of tokens (the plan gives every chunk its
own split over the SP ranks): the running chunk's split is runtime state, set by the
executor with `active_split` around the chunk's forward and backward, as `ops.offload`'s
ops read the running chunk's `ChunkMemory`. The process group is named by a string
(`register_group`), since graphs cannot hold one.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from sppo_fx.errors import SppoError

_GROUPS: dict[str, object] = {}
_MEMBERS: dict[str, list[int]] = {}
_active_split: list[tuple[int, ...]] = []


def register_group(name: str, group, ranks: list[int] | None = None) -> str:
    """Make `group` (a ProcessGroup of global `ranks`) reachable from graphs as `name`;
    returns the name."""
    _GROUPS[name] = group
    _MEMBERS[name] = list(ranks) if ranks is not None else []
    return name


@contextlib.contextmanager
def active_split(lengths):
    """The running chunk's tokens per SP rank (in rank order) while the block runs."""
    _active_split.append(tuple(int(n) for n in lengths))
    try:
        yield
    finally:
        _active_split.pop()


def _split(group_name: str, total: int) -> tuple[tuple[int, ...], object, int]:
    group = _GROUPS.get(group_name)
    if group is None:
        raise SppoError(f"sequence-parallel group {group_name!r} is not registered on this rank")
    size = dist.get_world_size(group)
    lengths = _active_split[-1] if _active_split else (total // size,) * size
    if len(lengths) != size or sum(lengths) != total:
        raise SppoError(f"sequence-parallel split {lengths} does not cover the chunk's {total} tokens "
                        f"over {size} ranks")
    return lengths, group, dist.get_rank(group)


def _all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, group_name: str) -> None:
    try:
        dist.all_to_all_single(out, inp, list(out_splits), list(in_splits), group=_GROUPS[group_name])
    except Exception as e:  # noqa: BLE001 - a peer died or failed: say which collective
        members = _MEMBERS.get(group_name) or "?"
        raise SppoError(f"sequence-parallel all-to-all failed ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}); a rank of the sequence-parallel "
                        f"group (ranks {members}) stopped or failed") from e


def _token(x: torch.Tensor) -> torch.Tensor:
    """A fresh token, made after this rank's collective has run (float: it carries a gradient)."""
    return torch.zeros((), dtype=torch.float32, device=x.device)


@torch.library.custom_op("sppo::seq_to_heads", mutates_args=())
def seq_to_heads(x: torch.Tensor, after: torch.Tensor | None, total: int, parts: int,
                 group: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, H, tokens of this rank, d] -> ([b, H/parts, `total` tokens of the chunk, d], token),
    run after the collective whose token is `after`."""
    lengths, _pg, rank = _split(group, total)
    b, h, local, d = x.shape
    if local != lengths[rank]:
        raise SppoError(f"this rank holds {local} tokens of the chunk, its split says {lengths[rank]}")
    block = h // parts
    # send head block j to rank j: [parts, b, block, local, d], flattened in that order
    send = x.reshape(b, parts, block, local, d).transpose(0, 1).contiguous().reshape(-1)
    recv = x.new_empty(b * block * total * d)
    _all_to_all(recv, send, [b * block * n * d for n in lengths], [b * block * local * d] * parts, group)
    pieces = recv.split([b * block * n * d for n in lengths])
    return torch.cat([p.view(b, block, n, d) for p, n in zip(pieces, lengths)], dim=2), _token(x)


@seq_to_heads.register_fake
def _(x, after, total, parts, group):
    b, h, _local, d = x.shape
    return x.new_empty(b, h // parts, total, d), x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("sppo::heads_to_seq", mutates_args=())
def heads_to_seq(x: torch.Tensor, after: torch.Tensor | None, local: int, parts: int,
                 group: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, H/parts, tokens of the chunk, d] -> ([b, H, `local` tokens of this rank, d], token),
    run after the collective whose token is `after`."""
    b, block, total, d = x.shape
    lengths, _pg, rank = _split(group, total)
    if local != lengths[rank]:
        raise SppoError(f"this rank holds {local} tokens of the chunk, its split says {lengths[rank]}")
    send = torch.cat([p.reshape(-1) for p in x.split(list(lengths), dim=2)])
    recv = x.new_empty(parts * b * block * local * d)
    _all_to_all(recv, send, [b * block * local * d] * parts, [b * block * n * d for n in lengths], group)
    # laid out as [b, tokens, heads, d] and returned transposed, as SDPA's output is: export
    # drops a model's `.transpose(1, 2).contiguous()` when it was free at trace time, so the
    # graph may `view` the transposed output directly
    out = recv.view(parts, b, block, local, d).permute(1, 3, 0, 2, 4).contiguous()
    return out.view(b, local, parts * block, d).transpose(1, 2), _token(x)


@heads_to_seq.register_fake
def _(x, after, local, parts, group):
    b, block, _total, d = x.shape
    return x.new_empty(b, local, block * parts, d).transpose(1, 2), x.new_empty((), dtype=torch.float32)


# The gradients' all-to-alls run in the reverse order of the forward's: op i's backward
# waits for its token's gradient, which op i+1's backward returns as the gradient of its
# `after` (op i's token), made by that backward's own collective.

def _seq_to_heads_setup(ctx, inputs, output):
    x, after, _total, parts, group = inputs
    ctx.local, ctx.parts, ctx.group, ctx.chained = x.shape[2], parts, group, after is not None


def _seq_to_heads_backward(ctx, grad, grad_token):
    gx, token = heads_to_seq(grad.contiguous(), grad_token, ctx.local, ctx.parts, ctx.group)
    return gx, token if ctx.chained else None, None, None, None


def _heads_to_seq_setup(ctx, inputs, output):
    x, after, _local, parts, group = inputs
    ctx.total, ctx.parts, ctx.group, ctx.chained = x.shape[2], parts, group, after is not None


def _heads_to_seq_backward(ctx, grad, grad_token):
    gx, token = seq_to_heads(grad.contiguous(), grad_token, ctx.total, ctx.parts, ctx.group)
    return gx, token if ctx.chained else None, None, None, None


seq_to_heads.register_autograd(_seq_to_heads_backward, setup_context=_seq_to_heads_setup)
heads_to_seq.register_autograd(_heads_to_seq_backward, setup_context=_heads_to_seq_setup)
