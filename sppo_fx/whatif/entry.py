"""Entry points of the what-if planner: `plan`, `plan_config`, `plan_simulation`,
`report_simulation`."""
from __future__ import annotations

import math
import time
from typing import Iterable, Optional

from sppo_fx.errors import InfeasibleBudget, SppoError
from sppo_fx.whatif.models import ModelSpec, get_model, parse_tokens
from sppo_fx.whatif.results import BASELINES, GiB, Cluster, PlanResult, WhatIfReport
from sppo_fx.whatif.search import _Candidate, _Planner
from sppo_fx.schedule.simulator import SimResult
from sppo_fx.solver.partition import balanced_lengths, multiplexed_lengths
from sppo_fx.solver.profiles import DeviceProfile, get_profile


def _profile(device) -> DeviceProfile:
    if isinstance(device, DeviceProfile):
        return device
    if str(device).strip().lower() == "cpu":  # this machine, measured (cached on disk)
        from sppo_fx.solver.calibration import calibrate
        return calibrate("cpu", seconds=1.0)
    return get_profile(str(device))


def _model(model) -> ModelSpec:
    return model if isinstance(model, ModelSpec) else get_model(str(model))


def plan(model, seq_len, gpus: int, device="a100-80gb", *, cluster: Optional[Cluster] = None,
         stages: Optional[int] = None, chunks: Optional[int] = None, shard_optimizer: bool = True,
         baselines: Iterable[str] = BASELINES) -> WhatIfReport:
    """Choose the SPPO plan (P, N, offload ratios) and predict it and the baselines.

    Args:
        model: a ModelSpec or a built-in name ("gpt-7b", "gpt-13b", "gpt-65b").
        seq_len: tokens per sequence (int or "4M" / "640K").
        gpus: total GPUs (= stages x sequence-parallel width).
        device: a DeviceProfile or a built-in profile name.
        cluster: interconnect / host-memory figures (default Cluster()).
        stages / chunks: fix P and/or N instead of searching.
        shard_optimizer: shard fp32 master weights and Adam states over the D ranks.
        baselines: which baselines to predict too.

    Returns:
        The WhatIfReport. Raises InfeasibleBudget (an SppoError) when no SPPO plan fits,
        naming the smallest device memory any configuration needs.
    """
    t0 = time.perf_counter()
    m, prof = _model(model), _profile(device)
    T = parse_tokens(seq_len)
    if not isinstance(gpus, int) or gpus < 1:
        raise SppoError(f"gpus must be a positive integer, got {gpus!r}")
    if chunks is not None and not (isinstance(chunks, int) and 1 <= chunks <= T):
        raise SppoError(f"chunks must be an integer in [1, {T}] (the sequence length), got {chunks!r}")
    cl = cluster or Cluster()
    pl = _Planner(m, T, gpus, prof, cl, shard_optimizer)
    if not pl.layouts(stages):
        why = f"stages={stages}: " if stages is not None else ""
        raise SppoError(f"{why}no pipeline layout of {gpus} GPUs fits {m.name}: stages must divide "
                        f"both gpus ({gpus}) and layers ({m.layers}), and gpus/stages must divide "
                        f"heads ({m.heads})")
    best = pl.search("sppo", stages, chunks)
    if best is None:
        need = pl.min_peak[0] + cl.reserve_bytes if pl.min_peak else float("nan")
        cand = pl.min_peak[1] if pl.min_peak else None
        where = (f" (the least-memory configuration is {cand.stages} stages x {cand.seq_parallel}-way "
                 f"sequence parallel, {len(cand.lengths)} chunks)") if cand else ""
        raise InfeasibleBudget(
            f"no SPPO plan for {m.name} at {T} tokens on {gpus} x {prof.name} fits in "
            f"{prof.memory_bytes / GiB:.1f} GiB of device memory: the minimum needed is at least "
            f"{need / GiB:.1f} GiB per GPU{where}, including {cl.reserve_bytes / GiB:.0f} GiB reserve "
            f"(static bytes, K/V and their gradients cannot be offloaded in this model). "
            f"Use more GPUs, a shorter sequence or a device with more memory.",
            int(need) if math.isfinite(need) else 0)
    base = {}
    for policy in baselines:
        pl.min_peak = None
        res = pl.search(policy, stages, chunks)
        base[policy] = res if res is not None else pl.infeasible(policy)
    return WhatIfReport(best=best, baselines=base, model=m, seq_len=T, gpus=gpus, profile=prof,
                        cluster=cl, shard_optimizer=shard_optimizer, candidates=pl.simulated,
                        search_seconds=time.perf_counter() - t0)


def plan_config(model, seq_len, gpus: int, device="a100-80gb", *, stages: int, chunks: int,
                policy: str = "sppo", cluster: Optional[Cluster] = None,
                shard_optimizer: bool = True, multiplexed: bool = False) -> PlanResult:
    """Plan and simulate one fixed configuration (P, N) under a policy.

    Args:
        model / seq_len / gpus / device / cluster / shard_optimizer: as for :func:`plan`.
        stages / chunks: P and N.
        policy: one of POLICIES.
        multiplexed: cut the first and last chunks P ways.

    Returns:
        The PlanResult; ``feasible`` is False (with the figures of the attempt) when the
        plan does not fit.
    """
    m, prof = _model(model), _profile(device)
    T = parse_tokens(seq_len)
    pl = _Planner(m, T, gpus, prof, cluster or Cluster(), shard_optimizer)
    if gpus % stages or m.layers % stages or m.heads % (gpus // stages):
        raise SppoError(f"stages={stages} does not fit {gpus} GPUs and {m.name} (stages must divide "
                        f"gpus and layers; gpus/stages must divide heads)")
    lengths = balanced_lengths(T, chunks, m.chunk_cost)
    if multiplexed:
        lengths = multiplexed_lengths(lengths, stages)
    cand = _Candidate(stages, gpus // stages, lengths, multiplexed)
    tab = pl.tables(cand, policy == "full_recompute")
    found = pl.evaluate(policy, cand, tab)
    if found is not None:
        return pl.result(policy, cand, found)
    n = len(lengths)
    ratios = ([[1.0] * (n - 1) + [0.0] for _ in range(stages)] if policy != "full_recompute" else None)
    sim = pl.run(cand, tab, ratios, "host")
    return pl.result(policy, cand, (sim, ratios or [[0.0] * n for _ in range(stages)], "host"),
                     feasible=False)


def plan_simulation(result: PlanResult, model=None, device=None, *, cluster: Optional[Cluster] = None,
                    shard_optimizer: bool = True) -> SimResult:
    """Re-simulate a PlanResult with every event recorded (for :mod:`sppo_fx.util.chrome_trace`).

    Args:
        result: a PlanResult from :func:`plan` or :func:`plan_config`.
        model: the ModelSpec or name (default: ``result.model``, which must be built-in).
        device: the profile or its name (default: ``result.device``).
        cluster / shard_optimizer: as used for the plan.

    Returns:
        The SimResult with events and memory timelines.
    """
    m = _model(model if model is not None else result.model)
    return _simulate_result(result, m, _profile(device or result.device), cluster, shard_optimizer)


def _simulate_result(result: PlanResult, m: ModelSpec, prof: DeviceProfile, cluster, shard) -> SimResult:
    pl = _Planner(m, result.seq_len, result.gpus, prof, cluster or Cluster(), shard)
    cand = _Candidate(result.stages, result.seq_parallel, list(result.chunk_lengths), result.multiplexed)
    tab = pl.tables(cand, result.policy == "full_recompute")
    ratios = result.offload_ratios if result.tier != "none" else None
    return pl.run(cand, tab, ratios, result.tier if result.tier in ("host", "disk") else "host",
                  record=True)


def report_simulation(report: WhatIfReport, policy: str = "sppo") -> SimResult:
    """The recorded simulation of one plan of a report (SPPO's by default)."""
    res = report.best if policy == "sppo" else report.baselines[policy]
    if not res.feasible:
        raise SppoError(f"the {policy} plan does not fit; there is nothing to simulate")
    return _simulate_result(res, report.model, report.profile, report.cluster, report.shard_optimizer)
