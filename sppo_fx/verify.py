"""`sppo_fx.compile(..., verify=True)`: at the first call, prove on this model and batch
that the transformed program trains as the unmodified model does.

The check runs a short prefix of the same batch twice: once through the program the real
step will run (same chunk lengths as the plan's first chunks, same offload, recompute,
pipeline and sequence-parallel layout), once through the user's model, eagerly and
unchunked. A causal LM's loss on a prefix is a function of the prefix alone, so the two
must agree; a pass that silently changes what the model computes (a mask proven causal
that is not, a wrong loss divisor, a wrong gradient handover between ranks) shows in the
loss or in some parameter's gradient. The first parameter that differs is named, with
how much. Gradients the user had accumulated before the call are put back either way.

Cost: one eager forward and backward of the prefix plus one chunked step over it, before
the first real step (with pipeline stages, also a second capture for the prefix's
shapes). Memory is bounded by the prefix, not the sequence, except for plans of one or
two chunks, whose prefix is the whole sequence.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.utils._pytree as pytree

from sppo_fx.capture import LossModule
from sppo_fx.errors import SppoError
from sppo_fx.plan import Plan

#: chunks of the plan the prefix covers (fewer for shorter plans, see `prefix_plan`)
PREFIX_CHUNKS = 3

#: largest |difference| / largest |reference| a gradient may show, by parameter dtype:
#: reassociated float sums (chunked attention, Inductor's kernels) differ in the last bits,
#: while a silently wrong pass moves gradients by O(1) of their size
TOLERANCE = {torch.float64: 1e-7, torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2}


def prefix_plan(plan: Plan) -> Plan:
    """The plan's first chunks: `PREFIX_CHUNKS` of them, but never the last chunk of a
    plan with more than two, so the prefix is shorter than the sequence whenever it can
    be and still crosses at least one chunk boundary."""
    n = plan.num_chunks
    k = n if n <= 2 else min(PREFIX_CHUNKS, n - 1)
    cut = slice(0, k)
    return dataclasses.replace(
        plan, seq_len=sum(plan.chunk_lengths[cut]), chunk_lengths=plan.chunk_lengths[cut],
        offload_ratios=None if plan.offload_ratios is None else plan.offload_ratios[cut],
        sp_splits=None if plan.sp_splits is None else plan.sp_splits[cut])


def prefix_call(call: tuple, seq_dim: int, seq_len: int, length: int) -> tuple:
    """(args, kwargs, target) with every tensor that has `seq_len` positions along
    `seq_dim` (the rule `capture` marks inputs dynamic by) cut to its first `length`."""
    leaves, spec = pytree.tree_flatten(call)
    # contiguous: the user's code may `view` its inputs (nanoGPT's `y.view(-1)`), which a
    # narrowed [B > 1, T] tensor would refuse
    cut = [x.narrow(seq_dim, 0, length).contiguous() if isinstance(x, torch.Tensor) and x.dim() > seq_dim
           and x.shape[seq_dim] == seq_len else x for x in leaves]
    return pytree.tree_unflatten(cut, spec)


@dataclasses.dataclass
class Verdict:
    """The first difference found: a parameter (index in `model.named_parameters()`,
    -1 for the loss), its name and relative difference; `index is None`: none."""

    index: int | None = None
    name: str = ""
    relative: float = 0.0
    detail: str = ""


def _relative(got: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    if got is None and ref is None:
        return 0.0
    if got is None or ref is None:  # one of them never reached the parameter
        other = ref if got is None else got
        return 0.0 if not other.abs().max().item() else math.inf
    scale = ref.abs().max().item()
    diff = (got.double() - ref.double()).abs().max().item()
    if not math.isfinite(diff):
        return math.inf
    return diff / scale if scale > 0 else (math.inf if diff > 0 else 0.0)


def compare(named: list[tuple[str, torch.nn.Parameter]], got: dict[str, torch.Tensor | None],
            ref: dict[str, torch.Tensor | None], got_loss: float | None, ref_loss: float,
            tolerance: float | None = None) -> Verdict:
    """The first of the loss (when `got_loss` is given) and the parameters in `got` whose
    value differs from `ref` by more than the tolerance of its dtype (`TOLERANCE`)."""
    if got_loss is not None:
        tol = tolerance or TOLERANCE.get(named[0][1].dtype if named else torch.float32, 1e-3)
        rel = abs(got_loss - ref_loss) / max(abs(ref_loss), 1e-12)
        if not rel <= tol:
            return Verdict(-1, "the loss", rel, f"{got_loss:.6g} against the model's {ref_loss:.6g}")
    for i, (name, p) in enumerate(named):
        if name not in got:
            continue
        tol = tolerance or TOLERANCE.get(p.dtype, 1e-3)
        rel = _relative(got[name], ref[name])
        if not rel <= tol:
            g, r = got[name], ref[name]
            detail = ("no gradient" if g is None else f"largest |gradient| {g.abs().max().item():.3g}") + \
                     " against the model's " + \
                     ("none" if r is None else f"{r.abs().max().item():.3g}")
            return Verdict(i, name, rel, detail)
    return Verdict()


def reference(model: torch.nn.Module, fn, loss_fn, calls: list[tuple]) -> tuple[float, dict]:
    """(loss, {name: grad}) of the unmodified model, eagerly, over `calls` (micro-batches,
    each weighted 1/len(calls), as a step weights them). Leaves every .grad None."""
    named = list(model.named_parameters())
    total = 0.0
    for args, kwargs, target in calls:
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs), target))
        slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        loss = LossModule(model, fn, loss_fn, spec, leaves, slots)(*(leaves[i] for i in slots))
        (loss / len(calls)).backward()
        total += loss.detach().item() / len(calls)
    grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in named}
    for _n, p in named:
        p.grad = None
    return total, grads


class SavedGrads:
    """Takes the model's gradients aside (every .grad None while inside), and puts them
    back on exit, whatever happens inside."""

    def __init__(self, model: torch.nn.Module):
        self._named = list(model.named_parameters())

    def __enter__(self):
        self._saved = [p.grad for _n, p in self._named]
        for _n, p in self._named:
            p.grad = None
        return self

    def take(self) -> dict[str, torch.Tensor | None]:
        """The gradients now on the parameters (and clear them)."""
        out = {n: None if p.grad is None else p.grad.detach().clone() for n, p in self._named}
        for _n, p in self._named:
            p.grad = None
        return out

    def __exit__(self, *exc):
        for (_n, p), g in zip(self._named, self._saved):
            p.grad = g
        return False


def fail(verdict: Verdict, where: str) -> None:
    """Raise the SppoError of a verdict that found a difference."""
    if verdict.index is None:
        return
    what = "loss" if verdict.index == -1 else f"gradient of {verdict.name!r}"
    raise SppoError(
        f"verify=True: the transformed program's {what} differs from the unmodified model's on {where}: "
        f"relative difference {verdict.relative:.3g}{f' ({verdict.detail})' if verdict.detail else ''}. The passes changed what the model "
        "computes; please report this with the model (and run without sppo_fx meanwhile)")


def agree(verdict: Verdict, named: list, device: torch.device) -> Verdict:
    """Every rank's verdict becomes the world's: the first differing parameter over all
    ranks (the loss first), so that every rank raises the same error. Collective."""
    import torch.distributed as dist
    index = len(named) if verdict.index is None else verdict.index
    mine = torch.tensor([float(index), verdict.relative if math.isfinite(verdict.relative) else 1e308],
                        dtype=torch.float64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    first = min(everyone, key=lambda t: (t[0].item(), -t[1].item()))
    index = int(first[0].item())
    if index >= len(named):
        return Verdict()
    # built from what every rank sees, so that every rank's message is the same
    name = "the loss" if index == -1 else named[index][0]
    return Verdict(index, name, first[1].item())
