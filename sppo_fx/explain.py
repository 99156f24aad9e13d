"""Readable summaries of a compiled model: plan, attention sites, program signatures."""
from __future__ import annotations

import torch.fx as fx
from tabulate import tabulate

from sppo_fx.capture import Captured
from sppo_fx.passes.seq_chunk import ChunkedProgram
from sppo_fx.plan import Plan


def signature(gm: fx.GraphModule, name: str, max_items: int = 12) -> str:
    """`name(a, b, ...) -> (x, y, ...)` of a GraphModule, long lists abbreviated."""
    def short(items):
        items = list(items)
        if len(items) > max_items:
            items = items[:max_items // 2] + [f"... {len(items) - max_items} more ..."] + items[-max_items // 2:]
        return ", ".join(items)
    ins = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    outs = [str(o) for o in (out if isinstance(out, (list, tuple)) else [out])]
    return f"{name}({short(ins)})\n    -> ({short(outs)})"


def explain(captured: Captured, program: ChunkedProgram, plan: Plan | None, compiled=None) -> str:
    """The text of `SppoCompiled.explain()`."""
    lo, hi = captured.seq_range
    lines = [f"sppo_fx: {type(captured.module.model).__name__}; sequence length {captured.seq} "
             f"traced for {lo} <= T <= {hi}",
             f"{len(program.params)} parameter/buffer inputs, {len(captured.input_names)} user inputs", ""]
    if plan is not None:
        lines += [f"Chunk plan (T = {plan.seq_len}, {plan.num_chunks} chunks):", plan.table(), ""]
    lines.append(f"Causal attention sites ({len(program.attention)}):")
    lines.append(tabulate([(a.name, a.k_shape, a.v_shape, a.source) for a in program.attention],
                          headers=["node", "K prefix [b,h,0,d]", "V prefix", "source"]))
    lines += ["", "Sequence reductions (accumulated over chunks):"]
    lines.append(tabulate([(r.name, r.op, r.source) for r in program.reductions], headers=["node", "op", "source"]))
    lines += ["", "User inputs:"]
    lines.append(tabulate([(n, label, "-" if d is None else f"dim {d}") for n, label, d in
                           zip(captured.input_names, captured.input_labels, captured.input_seq_dims)],
                          headers=["placeholder", "passed as", "sequence"]))
    lines += ["", "Values sliced per chunk (prologue outputs):"]
    lines.append(tabulate([(b.name, "whole" if b.seq_dim is None else f"dim {b.seq_dim}")
                           for b in program.boundaries], headers=["value", "sliced along"]))
    lines += ["", "Programs:",
              signature(program.prologue, "prologue"),
              signature(program.chunk, "chunk"),
              signature(program.epilogue, "epilogue")]
    lines.append("")
    if compiled is None:
        lines.append("Codegen: off (compile=False): the chunk program runs op by op as an FX graph")
    else:
        files = compiled.generated_code()
        traced = compiled.stats.exact_traces
        lines.append(f"Codegen: Inductor, {compiled.stats.compiles} compile(s) of the chunk program"
                     + (f" (and chunk 0's AOTAutograd graphs, traced at {traced} signature(s))" if traced else "")
                     + f"; generated code ({len(files)} modules, forward and backward):")
        lines += [f"    {f}" for f in files] or ["    (not compiled yet: runs on the first call)"]
    return "\n".join(lines)
