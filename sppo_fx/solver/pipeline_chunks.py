"""Adaptive pipeline scheduling: choose the chunk count N and the chunk lengths for P stages.

Predicted step time comes from simulating the schedule itself (`schedule.simulator.simulate`,
the one clock, with action durations from the cost model), so predictions and the runtime
share one source of truth. For a chunk of c tokens at start t on one of P stages:

    F = flops(c, t) / P / (rate · eff(c))        eff(c) = c / (c + c_half)
    B = backward_factor · F

Short chunks lose efficiency (eff), long ones make long fill/drain bubbles; the paper's
step time T = (P - 1 + N) / N · F(N) is the special case of equal chunks and one
micro-batch. `choose_plan` tries N over a range and both plain FLOPs-balanced and
multiplexed partitions, and reports the predicted bubble fraction of each.
"""
from __future__ import annotations

import dataclasses

from tabulate import tabulate

from sppo_fx.schedule import ActionKind, build_schedule
from sppo_fx.schedule.simulator import ActionCosts, simulate
from sppo_fx.solver.partition import ChunkCostModel, balanced_lengths, multiplexed_lengths


@dataclasses.dataclass
class ComputeModel:
    """How fast one device computes.

    Attributes:
        flops_per_s: sustained FLOP/s on long chunks.
        half_efficiency_tokens: chunk length at which efficiency is 50% (c_half).
    """

    flops_per_s: float
    half_efficiency_tokens: float = 64.0

    def efficiency(self, tokens: int) -> float:
        return tokens / (tokens + self.half_efficiency_tokens)


@dataclasses.dataclass
class PipelinePrediction:
    """Predicted figures of one (P, M, chunk lengths, schedule) choice.

    Attributes:
        stages / microbatches / schedule: the configuration.
        chunk_lengths: tokens per chunk.
        multiplexed: whether the first/last chunks were cut finer.
        step_seconds: predicted step time (schedule makespan).
        busy_seconds: compute time summed over stages.
        bubble_fraction: 1 - busy / (P · step).
    """

    stages: int
    microbatches: int
    schedule: str
    chunk_lengths: list[int]
    multiplexed: bool
    step_seconds: float
    busy_seconds: float

    @property
    def bubble_fraction(self) -> float:
        return 1.0 - self.busy_seconds / (self.stages * self.step_seconds) if self.step_seconds else 0.0

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_lengths)


def chunk_seconds(cost: ChunkCostModel, compute: ComputeModel, lengths: list[int], stages: int):
    """Per chunk (forward seconds, backward seconds) on one stage."""
    out, start = [], 0
    for c in lengths:
        f = cost.forward_flops(c, start) / stages / (compute.flops_per_s * compute.efficiency(c))
        out.append((f, f * cost.backward_factor))
        start += c
    return out


def predict(cost: ChunkCostModel, compute: ComputeModel, lengths: list[int], stages: int,
            microbatches: int = 1, schedule: str = "1f1b", multiplexed: bool = False) -> PipelinePrediction:
    """Simulate the schedule with durations from the cost model.

    Args:
        cost: FLOPs model of the whole model (split evenly over stages).
        compute: the device's compute model.
        lengths: chunk lengths of one micro-batch.
        stages / microbatches / schedule: the pipeline configuration.
        multiplexed: recorded in the result (the lengths already carry it).

    Returns:
        The PipelinePrediction.
    """
    times = chunk_seconds(cost, compute, lengths, stages)

    def duration(a):
        if a.kind is ActionKind.F:
            return times[a.chunk][0]
        if a.kind is ActionKind.B:
            return times[a.chunk][1]
        return 0.0

    sched = build_schedule(schedule, stages, microbatches, len(lengths))
    # the executor posts isend: sends never block; communication is not modelled here
    sim = simulate(sched, ActionCosts.from_callable(duration), link_bytes_per_s=None, link_latency_s=0.0,
                   record_events=False)
    busy = stages * microbatches * sum(f + b for f, b in times)
    return PipelinePrediction(stages, microbatches, schedule, list(lengths), multiplexed, sim.step_seconds, busy)


def choose_plan(cost: ChunkCostModel, compute: ComputeModel, seq_len: int, stages: int, microbatches: int = 1,
                schedule: str = "1f1b", min_chunk: int = 16, max_chunks: int = 64
                ) -> tuple[PipelinePrediction, list[PipelinePrediction]]:
    """The chunking with the least predicted step time.

    Args:
        cost / compute: the models.
        seq_len: tokens per micro-batch sequence.
        stages / microbatches / schedule: the pipeline.
        min_chunk: shortest chunk considered (tokens).
        max_chunks: most chunks considered.

    Returns:
        (best prediction, every prediction considered).
    """
    candidates = []
    n_max = max(1, min(max_chunks, seq_len // max(1, min_chunk)))
    n = 1
    while n <= n_max:
        lengths = balanced_lengths(seq_len, n, cost)
        candidates.append(predict(cost, compute, lengths, stages, microbatches, schedule))
        if stages > 1 and n > 1:
            mux = multiplexed_lengths(lengths, stages)
            candidates.append(predict(cost, compute, mux, stages, microbatches, schedule, multiplexed=True))
        n *= 2
    best = min(candidates, key=lambda p: (p.step_seconds, p.num_chunks))
    return best, candidates


def predictions_table(preds: list[PipelinePrediction]) -> str:
    """A table of predictions (one row each)."""
    rows = [(p.stages, p.microbatches, p.num_chunks, "yes" if p.multiplexed else "no",
             f"{p.step_seconds:.4g}", f"{p.bubble_fraction:.1%}",
             ",".join(map(str, p.chunk_lengths)) if p.num_chunks <= 10 else f"{p.chunk_lengths[:3]}...")
            for p in preds]
    return tabulate(rows, headers=["P", "M", "N", "multiplexed", "step s (pred)", "bubble", "chunk lengths"])
