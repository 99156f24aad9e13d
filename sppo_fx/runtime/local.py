"""Single-process executor: chunk forwards 0..N-1, then chunk backwards N-1..0.

`chunked_loss(program, params, inputs, plan)` returns a scalar loss whose backward fills
the parameters' `.grad` as the eager model would on the full sequence:

    forward   prologue(full inputs)
              for i in 0..N-1:  chunk_i(params, slices_i, K/V prefix = K/V of chunks < i)
              epilogue(sum of partials over chunks)          -> loss
    backward  epilogue'                                      -> d partials
              for i in N-1..0:  chunk_i'(d partials, dK_i, dV_i accumulated from chunks > i)
                                -> d params (summed), d prefix (split and added to dK_j, dV_j, j < i)

Each chunk keeps its own autograd graph; the K/V prefix enters it as a detached leaf, so
chunk j's backward runs only after every later chunk has contributed to dK_j, dV_j.
"""
from __future__ import annotations

import torch

from sppo_fx.passes.seq_chunk import ChunkedProgram
from sppo_fx.plan import Plan


class _ChunkState:
    __slots__ = ("partials", "kv", "prefix")

    def __init__(self, partials, kv, prefix):
        self.partials, self.kv, self.prefix = partials, kv, prefix


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, *grad_params):
        ctx.run = run
        return run.forward()

    @staticmethod
    def backward(ctx, grad):
        run = ctx.run
        ctx.run = None
        return (None, *run.backward(grad))


class ChunkedRun:
    """One forward/backward of a ChunkedProgram over one plan (holds the per-chunk graphs)."""

    def __init__(self, program: ChunkedProgram, params: list[torch.Tensor], inputs: list[torch.Tensor],
                 plan: Plan, needs_grad: bool, chunk_fn=None):
        self.program, self.plan, self.inputs = program, plan, inputs
        self.chunk_fn = chunk_fn if chunk_fn is not None else program.chunk
        self.needs_grad = needs_grad
        self.grad_index = [i for i, p in enumerate(params) if p.requires_grad and needs_grad]
        self.params = [p.detach().requires_grad_() if i in self.grad_index else p.detach()
                       for i, p in enumerate(params)]
        self.states: list[_ChunkState | None] = []
        self.totals = []
        self.loss = None

    @property
    def grad_leaves(self):
        return [self.params[i] for i in self.grad_index]

    def _prefix(self, i: int, device) -> list[torch.Tensor]:
        prefix = []
        for j, site in enumerate(self.program.attention):
            for which, shape in ((0, site.k_shape), (1, site.v_shape)):
                if i == 0:
                    t = torch.empty(shape, dtype=site.dtype, device=device)
                else:
                    t = torch.cat([self.states[m].kv[2 * j + which].detach() for m in range(i)], dim=-2)
                prefix.append(t.requires_grad_(self.needs_grad))
        return prefix

    def forward(self) -> torch.Tensor:
        prog, plan = self.program, self.plan
        device = self.inputs[0].device if self.inputs else None
        with torch.no_grad():
            boundary = prog.prologue(plan.seq_len, *self.inputs)
        n_part = prog.num_partials
        with torch.set_grad_enabled(self.needs_grad):
            for i, (start, end) in enumerate(plan.bounds()):
                slices = [b if spec.seq_dim is None else b.narrow(spec.seq_dim, start, end - start)
                          for spec, b in zip(prog.boundaries, boundary)]
                prefix = self._prefix(i, device)
                outs = self.chunk_fn(*self.params, *slices, *prefix, start, end - start)
                self.states.append(_ChunkState(list(outs[:n_part]), list(outs[n_part:]), prefix))
            totals = []
            for k in range(n_part):
                acc = self.states[0].partials[k].detach()
                for st in self.states[1:]:
                    acc = acc + st.partials[k].detach()
                totals.append(acc.requires_grad_(self.needs_grad and acc.is_floating_point()))
            self.totals = totals
            index = {name: k for k, name in enumerate(prog.params)}
            epi_params = [self.params[index[name]] for name in prog.epilogue_params]
            (self.loss,) = prog.epilogue(plan.seq_len, *epi_params, *totals)
        return self.loss.detach()

    def backward(self, grad: torch.Tensor) -> list[torch.Tensor | None]:
        leaves = self.grad_leaves
        param_grads: list[torch.Tensor | None] = [None] * len(leaves)

        def add_param_grads(gs):
            for k, g in enumerate(gs):
                if g is not None:
                    param_grads[k] = g if param_grads[k] is None else param_grads[k] + g

        totals = [t for t in self.totals if t.requires_grad]
        gs = torch.autograd.grad(self.loss, totals + leaves, grad, allow_unused=True)
        total_grads = dict(zip(map(id, totals), gs[:len(totals)]))
        add_param_grads(gs[len(totals):])
        self.loss = None
        lengths = self.plan.chunk_lengths
        kv_grads: list[list[torch.Tensor | None]] = [[None] * (2 * len(self.program.attention))
                                                     for _ in lengths]
        for i in range(len(lengths) - 1, -1, -1):
            st = self.states[i]
            outs, grads = [], []
            for t, p in zip(self.totals, st.partials):
                g = total_grads.get(id(t))
                if g is not None and p.requires_grad:
                    outs.append(p)
                    grads.append(g)
            for t, g in zip(st.kv, kv_grads[i]):
                if g is not None and t.requires_grad:
                    outs.append(t)
                    grads.append(g)
            prefix = st.prefix if i > 0 else []
            if outs:
                gs = torch.autograd.grad(outs, leaves + prefix, grads, allow_unused=True)
                add_param_grads(gs[:len(leaves)])
                for j, gp in enumerate(gs[len(leaves):]):
                    if gp is None:
                        continue
                    for m, part in enumerate(gp.split(lengths[:i], dim=-2)):
                        acc = kv_grads[m][j]
                        kv_grads[m][j] = part if acc is None else acc + part
            self.states[i] = None
            kv_grads[i] = None
        return param_grads


def chunked_loss(program: ChunkedProgram, params: list[torch.Tensor], inputs: list[torch.Tensor],
                 plan: Plan, chunk_fn=None) -> torch.Tensor:
    """Run the chunk programs over `plan`; the result backpropagates into `params`.

    Args:
        program: the prologue/chunk/epilogue graphs.
        params: tensors for the program's parameter placeholders, in order.
        inputs: the flat user input tensors (full sequence).
        plan: the chunk partition.
        chunk_fn: what runs the chunk program (default: the GraphModule itself, eagerly;
            `codegen.CompiledProgram` for Inductor).

    Returns:
        The scalar loss (equal to the eager model's on the full sequence).
    """
    grad_params = [p for p in params if p.requires_grad]
    needs_grad = torch.is_grad_enabled() and bool(grad_params)
    run = ChunkedRun(program, params, inputs, plan, needs_grad, chunk_fn)
    if not needs_grad:
        return run.forward()
    return _ChunkedLoss.apply(run, *grad_params)
