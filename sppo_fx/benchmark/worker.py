"""One benchmark row, run in its own process (fresh allocator, caches and RSS high-water).

    python -m sppo_fx.benchmark.worker '<BenchConfig JSON>' <gradients file>

Prints one JSON line of measurements (the last line of stdout) and saves the parameter
gradients of the last step to the gradients file (the engine compares them with eager's).

Measured:
- first_s: the first call (capture, solving, compiling, calibrating, and one step);
  first_phases (library rows): its seconds by phase (`sppo_fx.util.log.record_phases`, an
  "other" row for the rest: running the step, Python) and first_log the progress lines
  logged during it, each prefixed by its seconds since the call began;
- step_s: median of the timed steps after it (compiled library rows: after one more untimed
  step and the wait for chunk 0's background compile, `background_compile_wait_s`);
- peak_extra_bytes: on a CPU the process's RSS high-water (VmHWM, reset just before each
  timed step) minus its RSS at that point, gradients freed; on CUDA
  `max_memory_allocated` (peak stats reset) minus `memory_allocated` at the same point.
  Activations, temporaries and parameter gradients all count; the largest over the steps;
- predicted_peak_bytes / predicted_step_s: what the library's plan predicts (library rows);
  predicted_terms: that step's terms (compute, attention, exposed_copy, overhead);
- copy_overlap: with SPPO_BENCH_COPY_OVERLAP=1, rows that offload run one more step under
  torch.profiler after the timed ones: the store's copy time and the part of it hidden
  behind compute (`copy_overlap.py`).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import sys
import time

import torch

from sppo_fx.benchmark.config import BenchConfig, min_headroom
from sppo_fx.benchmark.copy_overlap import COPY_OVERLAP_ENV, profile_step
from sppo_fx.errors import InfeasibleBudget
from sppo_fx.util.log import record_phases, summarize
from sppo_fx.util.rss import rss_bytes, start_peak

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _anchor_step(cfg: BenchConfig, model, x, y):
    if cfg.kind == "checkpoint":
        from torch.utils.checkpoint import checkpoint
        for block in getattr(model, "layers", None) or model.h:
            block.forward = (lambda f: lambda *a: checkpoint(f, *a, use_reentrant=False))(block.forward)
    if cfg.kind in ("compile", "compile-amb"):
        if cfg.kind == "compile-amb":
            import torch._functorch.config as functorch_config
            functorch_config.activation_memory_budget = cfg.amb
        fn = torch.compile(model)
    else:
        fn = model

    def step():
        loss = fn(x, y)
        loss.backward()
        return loss.detach()
    return step


def _library(cfg: BenchConfig, model, budget):
    import sppo_fx
    return sppo_fx.compile(model, budget=budget, chunks=cfg.chunks, compile=cfg.compile, stages=cfg.stages,
                           microbatches=cfg.microbatches, schedule=cfg.schedule, partition=cfg.partition,
                           recompute=cfg.recompute, skeleton=cfg.skeleton, offload_dir=cfg.offload_dir,
                           offload=cfg.offload or (("host" if cfg.device == "cuda" else "disk") if budget else None),
                           timeout_s=300)


def _minimum_budget(cfg: BenchConfig, model, x, y) -> int:
    """The solver's smallest feasible budget for this row (from InfeasibleBudget)."""
    probe = _library(cfg, model, 1)
    try:
        probe(x, y)
    except InfeasibleBudget as e:
        return e.minimum_bytes
    raise AssertionError("a 1-byte budget was accepted")


def _prediction(compiled) -> tuple[int | None, float | None]:
    """(predicted peak bytes, predicted step seconds) of the plan that ran.

    A budget plan carries both; any other single-stage plan (fixed chunks, a manual
    offload tier) is predicted by the same models (`SppoCompiled.predicted`); a pipeline
    plan chosen by the solver carries a step time only."""
    plan = compiled.plan
    if compiled.options.stages == 1:
        return compiled.predicted()
    peak, seconds = getattr(plan, "peak_bytes", None), getattr(plan, "step_seconds", None)
    pred = compiled.pipeline_prediction()
    if seconds is None and pred:
        seconds = pred[0].step_seconds
    return peak, seconds


def _terms(compiled) -> dict | None:
    """The predicted step's terms (`solver.clock.StepTerms` as a dict) of a single-stage
    plan: the solver's, or the same models' for a plan it did not choose; None otherwise."""
    if compiled.options.stages != 1:
        return None
    if compiled.plan.step_terms:
        return dict(compiled.plan.step_terms)
    from sppo_fx.orchestrate.stage import device_profile, memory_models
    from sppo_fx.solver.predict import predict_terms
    e, o = compiled._require_entry(), compiled.options
    (memory,) = memory_models(e, (o.recompute_for(compiled.plan),))
    profile = device_profile(e, o, compiled.profile)
    terms = predict_terms(e.cost, memory, compiled.plan, offload=o.offload, skeleton=o.skeleton_for(compiled.plan),
                          profile=profile, device=e.device(), compiled=o.compile)[2]
    return {k: float(v) for k, v in vars(terms).items()}


@contextlib.contextmanager
def _progress_lines():
    """The library's progress lines logged inside the block (INFO and above), each as
    "<seconds since the block began> <message>": where a first call's time went, phases
    inside phases included (`first_phases` has the outermost only)."""
    import logging
    from sppo_fx.util.log import ROOT
    lines: list[str] = []
    t0 = time.perf_counter()

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(f"{time.perf_counter() - t0:7.1f} {record.getMessage()}")

    handler, logger = Keep(logging.INFO), logging.getLogger(ROOT)
    level = logger.level
    logger.setLevel(min(level, logging.INFO) if level else logging.INFO)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def run_config(cfg: BenchConfig, grads_out: str | None) -> dict:
    """Run one row in this process (one rank of it when stages > 1); its measurements."""
    from sppo_fx.models import build
    rank = 0
    if cfg.kind == "sppo" and cfg.stages > 1:
        from sppo_fx.runtime.distributed import init_from_env
        rank, _ = init_from_env(300)
    device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]
    if device.type == "cuda" and cfg.kind == "sppo" and cfg.stages > 1:
        from sppo_fx.runtime.distributed import rank_device
        device = rank_device()  # each pipeline rank on its own GPU (NCCL)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = build(cfg.model, cfg.size)
    if cuda or dtype != torch.float32:
        model = model.to(device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    v = model.config.vocab_size
    x = torch.randint(0, v, (cfg.batch, cfg.seq_len), generator=gen).to(device)
    y = torch.randint(0, v, (cfg.batch, cfg.seq_len), generator=gen).to(device)
    out: dict = {"rank": rank}
    compiled = None
    if cfg.is_anchor:
        step = _anchor_step(cfg, model, x, y)
    else:
        budget = cfg.budget_bytes
        headroom = min_headroom(cfg.budget)
        if headroom is not None:
            minimum = _minimum_budget(cfg, model, x, y)
            budget = math.ceil(minimum * (1 + headroom))
            out.update(minimum_budget_bytes=minimum, budget_bytes=budget)
        compiled = _library(cfg, model, budget)
        step = lambda: compiled.step(x, y)  # noqa: E731
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    barrier = torch.distributed.barrier if compiled is not None and cfg.stages > 1 else (lambda: None)
    model.zero_grad(set_to_none=True)
    with record_phases() as phases, _progress_lines() as lines:
        t = time.perf_counter()
        loss = step()
        sync()
        out["first_s"] = time.perf_counter() - t
    if compiled is not None:
        out["first_phases"] = [[name, round(s, 2)] for name, s in summarize(phases, out["first_s"])]
        out["first_log"] = lines
    codegen = compiled.codegen if compiled is not None and compiled.options.compile and cfg.stages == 1 else None
    if codegen is not None:
        # chunk 0's Inductor program compiles in a forked child from its second call on
        # (codegen/background.py): an untimed step starts it and the wait takes it, so the
        # timed steps are the steady ones and no compile shares their cores
        model.zero_grad(set_to_none=True)
        step()
        t = time.perf_counter()
        codegen.wait_background()
        out["background_compile_wait_s"] = time.perf_counter() - t
    times, peaks = [], []
    for _ in range(cfg.steps):
        model.zero_grad(set_to_none=True)
        base = None if cuda else start_peak(strict=True)  # before the barrier: ranks start the step together
        barrier()
        sync()
        if cuda:
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        t = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t)
        peaks.append((torch.cuda.max_memory_allocated(device) if cuda else rss_bytes("VmHWM", strict=True)) - base)
    out.update(step_s=statistics.median(times), step_times=times, peak_extra_bytes=max(max(peaks), 0),
               loss=float(loss))
    if compiled is not None:
        out["predicted_peak_bytes"], out["predicted_step_s"] = _prediction(compiled)
        out["predicted_terms"] = _terms(compiled)
        plan = compiled.plan
        out["plan"] = {"chunks": plan.num_chunks, "recompute": plan.recompute, "skeleton": plan.skeleton,
                       "offloaded_chunks": sum(1 for a in plan.offload_ratios or () if a > 0)}
    if compiled is not None and cfg.stages == 1 and compiled.options.offload and os.environ.get(COPY_OVERLAP_ENV):
        # one more step, profiled, after the timed ones (the profiler would perturb them)
        model.zero_grad(set_to_none=True)
        sync()
        _, overlap = profile_step(step, cuda=cuda)
        out["copy_overlap"] = overlap.to_dict()
    if cuda:
        out["gpu"] = torch.cuda.get_device_name(device)
    if grads_out:
        grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
        torch.save(grads, grads_out if rank == 0 else f"{grads_out}.rank{rank}")
    if compiled is not None and cfg.stages > 1:
        torch.distributed.destroy_process_group()
    return out


if __name__ == "__main__":
    result = run_config(BenchConfig(**json.loads(sys.argv[1])), sys.argv[2] if len(sys.argv) > 2 else None)
    print(json.dumps(result))
