"""What the orchestrator (sppo_fx/orchestrate/) hands the runtime: plain data, ready to run.

A `StageProduct` is one stage's transformed, planned and compiled program; a `RankProduct`
adds what one pipeline rank needs on top (its schedule and the parameters it shares with
other stages). The runtime reads these and runs them: it never captures, transforms,
solves or compiles (docs/architecture.md, section 1).
"""
from __future__ import annotations

import dataclasses

import torch

from sppo_fx.passes.seq_chunk import ChunkedProgram
from sppo_fx.plan import Plan
from sppo_fx.schedule import Schedule


@dataclasses.dataclass
class StageProduct:
    """One stage, ready to run.

    Attributes:
        program: the prologue / chunk / epilogue graphs.
        params: tensors for the program's parameter placeholders, in order.
        plan: the chunk plan (with a budget: the solver's offload ratios, recompute policy
            and skeleton place).
        chunk_fn: what runs the chunk program: a `codegen.CompiledProgram` (Inductor, or
            eager with the memory passes), or None for the chunk GraphModule op by op.
        skeleton: where the K/V skeleton lives, "keep" or "offload" (then `chunk_fn` runs
            the streamed chunk program of `passes.skeleton`).
        offload: {(micro-batch, chunk): bytes} a budget plan offloads, or None (with an
            offload tier: everything every chunk but the last saves).
        tier: the offload tier the store is built for ("disk", "host", "device"; with
            offload="auto" the plan's, chosen by the solver), None: no store.
    """

    program: ChunkedProgram
    params: list[torch.Tensor]
    plan: Plan
    chunk_fn: object = None
    skeleton: str = "keep"
    offload: dict | None = None
    tier: str | None = None


@dataclasses.dataclass
class RankProduct(StageProduct):
    """One pipeline rank's stage, ready to run.

    Attributes:
        schedule: the per-stage action lists (with OFFLOAD actions where chunks offload).
        shared: for parameters several stages use (tied embeddings),
            {local param index: (global id, [stages using it])}.
    """

    schedule: Schedule | None = None
    shared: dict = dataclasses.field(default_factory=dict)
