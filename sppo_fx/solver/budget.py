"""The budget solver: chunk count, chunk lengths and per-chunk offload ratios for a memory
budget (DESIGN.md, Semantics 4; the paper's sequence-aware offloading).

Memory model of one sequence on one device (bytes; chunk i has c_i tokens at start t_i):

    L1_i   its K/V skeleton (read by every later chunk, kept for the whole step)
    L2_i   everything else it saves for its own backward (what is offloaded)
    a_i    the fraction of L2_i offloaded (a_{N-1} = 0: the last chunk runs backward first)

    forward, after chunk j:   sum_{i<=j} L1_i + sum_{i<j} (1 - a_i) L2_i + L2_j
    backward, at chunk j:     sum_i L1_i + dK/dV (sum_{i<j} L1_i) + sum_{i<j} (1 - a_i) L2_i
                              + L2_j + a_{j-1} L2_{j-1} (prefetched) + parameter gradients
    peak = the largest of these, plus `fixed_bytes` (what the model allocates regardless)

Sequence-aware offload: chunk i's offload is sized to hide behind chunk i+1's forward at
the tier's write bandwidth, a_i = min(1, bw · t_fwd(i+1) / L2_i). When the peak still
exceeds the budget, the earliest chunks (which wait longest for their backward) go to
a_i = 1 first; then more chunks are tried. Offload beyond what hides costs
(bytes − hidden) / bw of stall. The solver returns the feasible plan with the least
predicted step time, or raises InfeasibleBudget with the smallest feasible budget.
"""
from __future__ import annotations

import dataclasses

from sppo_fx.errors import InfeasibleBudget, SppoError
from sppo_fx.plan import Plan
from sppo_fx.solver.partition import ChunkCostModel, balanced_lengths

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_budget(budget) -> int:
    """Bytes from an int or a string such as "12GiB", "500MiB", "1.5GB".

    Raises SppoError naming the accepted forms for anything else.
    """
    if isinstance(budget, bool):
        raise SppoError("budget must be bytes (int) or a string like '24GiB'")
    if isinstance(budget, (int, float)):
        if budget <= 0:
            raise SppoError(f"budget must be positive, got {budget}")
        return int(budget)
    if isinstance(budget, str):
        text = budget.strip().lower().replace(" ", "")
        num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(num):]
        if num and unit in _UNITS:
            try:
                value = float(num) * _UNITS[unit]
            except ValueError:
                value = -1
            if value > 0:
                return int(value)
    raise SppoError(f"cannot read budget {budget!r}: give bytes (int) or a string like '24GiB', '500MiB', '2GB'")


@dataclasses.dataclass
class MemoryModel:
    """Per-chunk bytes as functions of (c, p), plus what every step allocates anyway.

    Attributes:
        level1: (c, p) -> K/V bytes of a chunk.
        level2: (c, p) -> chunk-private saved bytes.
        fixed_bytes: allocated by every step regardless of chunking (parameter gradients).
        working: (c, p) -> transient bytes while a chunk runs (its largest temporaries).
    """

    level1: object
    level2: object
    fixed_bytes: int = 0
    working: object = None

    @classmethod
    def from_chunk_cost(cls, chunk_cost, fixed_bytes: int = 0) -> "MemoryModel":
        """From `sppo_fx.passes.cost.ChunkCost` (sympy in c, p)."""
        def at(key):
            return lambda c, p: int(chunk_cost.evaluate(c, p)[key])
        return cls(at("level1_bytes"), at("level2_bytes"), fixed_bytes)


def predict_peak(mem: MemoryModel, lengths: list[int], ratios: list[float]) -> int:
    """Peak device bytes of one step (see the module docstring)."""
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    l1 = [mem.level1(c, t) for c, t in zip(lengths, starts)]
    l2 = [mem.level2(c, t) for c, t in zip(lengths, starts)]
    work = [mem.working(c, t) if mem.working else 0 for c, t in zip(lengths, starts)]
    peak, kept = 0, 0.0
    for j in range(len(lengths)):  # forward
        peak = max(peak, sum(l1[:j + 1]) + kept + l2[j] + work[j])
        kept += (1 - ratios[j]) * l2[j]
    skeleton = sum(l1)
    for j in range(len(lengths) - 1, -1, -1):  # backward
        resident = sum((1 - ratios[i]) * l2[i] for i in range(j))
        prefetched = ratios[j - 1] * l2[j - 1] if j > 0 else 0
        peak = max(peak, skeleton + sum(l1[:j]) + resident + l2[j] + prefetched + work[j] + mem.fixed_bytes)
    return int(peak)


@dataclasses.dataclass
class BudgetPlan:
    """What the budget solver chose (also stored in the Plan)."""

    lengths: list[int]
    ratios: list[float]
    peak_bytes: int
    step_seconds: float


def _step_seconds(cost: ChunkCostModel, lengths, ratios, l2, rate, c_half, bw) -> float:
    fwd = [cost.forward_flops(c, t) / (rate * c / (c + c_half))
           for c, t in zip(lengths, [sum(lengths[:i]) for i in range(len(lengths))])]
    total = sum(f * (1 + cost.backward_factor) for f in fwd)
    stall = 0.0
    for i, a in enumerate(ratios):
        if a <= 0:
            continue
        copy = a * l2[i] / bw
        hide_fwd = fwd[i + 1] if i + 1 < len(fwd) else 0.0
        hide_bwd = fwd[i + 1] * cost.backward_factor if i + 1 < len(fwd) else 0.0
        stall += max(copy - hide_fwd, 0.0) + max(copy - hide_bwd, 0.0)  # write, then read back
    return total + stall


def solve(cost: ChunkCostModel, mem: MemoryModel, seq_len: int, budget: int, *, rate: float, bandwidth: float,
          c_half: float = 64.0, chunk_counts=None, lengths_for=None) -> BudgetPlan:
    """Choose chunks and offload ratios that fit `budget` with the least predicted time.

    Args:
        cost: FLOPs model (for times and FLOPs-balanced lengths).
        mem: bytes model.
        seq_len: tokens T.
        budget: device bytes.
        rate: sustained FLOP/s; bandwidth: offload tier bytes/s (write and read).
        c_half: chunk length at 50% compute efficiency.
        chunk_counts: candidate N (default 1, 2, 4, ... up to T/16).
        lengths_for: N -> lengths (default FLOPs-balanced).

    Returns:
        The BudgetPlan. Raises InfeasibleBudget (with the minimum) when nothing fits.
    """
    if chunk_counts is None:
        chunk_counts, n = [], 1
        while n <= max(1, seq_len // 16) and n <= 256:
            chunk_counts.append(n)
            n *= 2
    lengths_for = lengths_for or (lambda n: balanced_lengths(seq_len, n, cost))
    best, minimum = None, None
    for n in chunk_counts:
        if n > seq_len:
            break
        lengths = lengths_for(n)
        starts = [sum(lengths[:i]) for i in range(n)]
        l2 = [mem.level2(c, t) for c, t in zip(lengths, starts)]
        fwd_s = [cost.forward_flops(c, t) / (rate * c / (c + c_half)) for c, t in zip(lengths, starts)]
        # sequence-aware: hide each chunk's offload behind the next chunk's forward
        ratios = [min(1.0, bandwidth * fwd_s[i + 1] / l2[i]) if l2[i] > 0 else 0.0 for i in range(n - 1)] + [0.0]
        floor = predict_peak(mem, lengths, [1.0] * (n - 1) + [0.0])
        minimum = floor if minimum is None else min(minimum, floor)
        for i in range(n):  # earliest chunks leave the device first until the plan fits
            if predict_peak(mem, lengths, ratios) <= budget or i == n - 1:
                break
            ratios[i] = 1.0
        peak = predict_peak(mem, lengths, ratios)
        if peak > budget:
            continue
        # fits: offload only what the budget needs beyond the hidden copies? keep hidden ones
        plan = BudgetPlan(lengths, ratios, peak, _step_seconds(cost, lengths, ratios, l2, rate, c_half, bandwidth))
        if best is None or plan.step_seconds < best.step_seconds:
            best = plan
    if best is None:
        raise InfeasibleBudget(
            f"budget {budget / 2**20:.1f} MiB is below the minimum any plan needs for {seq_len} tokens: "
            f"{minimum / 2**20:.1f} MiB (every chunk but the last offloaded). Raise the budget to at least "
            f"{minimum / 2**20:.1f} MiB or shorten the sequence", minimum or 0)
    return best


def budget_plan(seq_len: int, chosen: BudgetPlan, budget: int, tier: str) -> Plan:
    """The Plan carrying the solver's choice."""
    return Plan(seq_len, chosen.lengths, offload_ratios=chosen.ratios, tier=tier, budget_bytes=budget,
                peak_bytes=chosen.peak_bytes, step_seconds=chosen.step_seconds)
