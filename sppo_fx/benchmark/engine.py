"""The benchmark engine: every row in its own process, interleaved rounds, paired ratios.

Round k runs every row of the grid once, in grid order, with the eager anchor of each
dtype/device group first (a budget such as "25%" is a fraction of eager's measured peak
extra memory, taken from the first round; eager's gradients are the reference of every
row's gradient difference). A grid with library rows but no eager anchor gets one.

Combining rounds: step time is the median over rounds; the ratio to the baseline row is
the median of the per-round ratios, each against the baseline's run in the same round (so
the machine's drift between processes cancels), and their spread (min..max) is kept; peak
memory and gradient difference are the worst of the rounds.

A ratio whose denominator is within noise of zero is None (printed "–" with a footnote):
the noise of a peak is the larger of NOISE_FLOOR_BYTES and the baseline's spread of peaks
over rounds (a baseline that measured 0 in one round and 60 MiB in another says nothing);
the noise of a step time is NOISE_FLOOR_S.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from sppo_fx.benchmark.config import BenchConfig, min_headroom, resolve_budget
from sppo_fx.errors import SppoError
from sppo_fx.util.log import ENV as LOG_ENV
from sppo_fx.util.log import PREFIX as LOG_PREFIX

NOISE_FLOOR_BYTES = 4 * 2**20  # RSS moves by this much between identical runs (malloc, threads)
#: glibc settings of every benchmark worker: a fixed mmap threshold makes glibc return every
#: large freed block to the OS, so RSS follows live tensors (its dynamic threshold would keep
#: freed gradients resident). Every such block then gets fresh pages (docs/solver-clock.md,
#: "Fresh pages in a step against the allocation probe").
BENCH_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
NOISE_FLOOR_S = 1e-3
BUDGET_TOLERANCE = (0.10, 16 * 2**20)  # measured peak <= budget * (1 + 10%) + 16 MiB


def ratio(num: float | None, den: float | None, noise: float) -> float | None:
    """num / den, or None when either is missing or den is within `noise` of zero."""
    if num is None or den is None or abs(den) <= noise:
        return None
    return num / den


def _error_line(stderr: str) -> str:
    """The exception line of a worker's traceback (not a trailing hint)."""
    lines = [ln.strip() for ln in (stderr or "").strip().splitlines()]
    for ln in reversed(lines):
        head = ln.split(":", 1)[0]
        if ":" in ln and " " not in head and (head.endswith(("Error", "Exception", "Budget")) or "." in head):
            return ln
    return lines[-1] if lines else ""


def _timed_out(timeout: float, stderr) -> dict:
    """The error of a row that ran out of time, with the plan it was running and its last
    progress line (the worker logs its phases): a timeout then says why."""
    if isinstance(stderr, bytes):
        stderr = stderr.decode(errors="replace")
    lines = [ln.strip() for ln in (stderr or "").splitlines() if ln.startswith(LOG_PREFIX)]
    plan = next((ln for ln in reversed(lines) if ln.startswith(f"{LOG_PREFIX} plan:")), None)
    said = [ln[len(LOG_PREFIX):].strip() for ln in (plan, lines[-1] if lines else None) if ln]
    detail = "; ".join(dict.fromkeys(said))  # the plan line may be the last line too
    return {"error": f"timed out after {timeout:g} s" + (f" ({detail})" if detail else "")}


def run_row(cfg: BenchConfig, grads_out: str | None, timeout: float | None = None) -> dict:
    """Run one row in fresh process(es); its measurements or {"error": ...}."""
    cmd = [sys.executable, "-m", "sppo_fx.benchmark.worker", json.dumps(cfg.to_dict())] + (
        [grads_out] if grads_out else [])
    env = dict(os.environ, **BENCH_MALLOC_ENV)
    env.setdefault(LOG_ENV, "info")  # its progress lines: what a timed-out row was doing
    if cfg.is_anchor or cfg.stages == 1:
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            return _timed_out(timeout, e.stderr)
        if res.returncode:
            return {"error": _error_line(res.stderr) or f"exit code {res.returncode}"}
        return json.loads(res.stdout.strip().splitlines()[-1])
    from sppo_fx.runtime.launch import start_local_ranks
    # start_local_ranks sets each rank's environment itself: pass the malloc settings through env(1)
    procs = start_local_ranks(["env"] + [f"{k}={v}" for k, v in BENCH_MALLOC_ENV.items()] + cmd, cfg.stages)
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        return {"error": f"timed out after {timeout:g} s"}
    if any(p.returncode for p in procs):
        err = next(e for (o, e), p in zip(outs, procs) if p.returncode)
        return {"error": _error_line(err) or "a rank failed"}
    ranks = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    merged = dict(ranks[-1])
    for key in ("step_s", "first_s", "peak_extra_bytes"):  # the slowest / fullest rank
        merged[key] = max(r[key] for r in ranks)
    merged["per_rank"] = ranks
    if grads_out:  # each rank holds the gradients of its stage's parameters
        import torch
        grads = {}
        for path in sorted(glob.glob(grads_out + "*")):
            grads.update(torch.load(path))
            if path != grads_out:
                os.remove(path)
        torch.save(grads, grads_out)
    return merged


def _grad_diff(path: str, ref: dict | None) -> float | None:
    import torch
    if ref is None or not os.path.exists(path):
        return None
    grads = torch.load(path)
    if set(grads) != set(ref):
        return float("inf")  # a parameter without (or with an extra) gradient
    return max((grads[k] - ref[k]).abs().max().item() for k in ref)


def _group(cfg: BenchConfig) -> tuple:
    return cfg.model, cfg.size, cfg.seq_len, cfg.batch, cfg.dtype, cfg.device


def with_eager_reference(configs: list[BenchConfig]) -> list[BenchConfig]:
    """The grid with an eager anchor in every dtype/device group that has none, eager first."""
    out = list(configs)
    for cfg in configs:
        if not cfg.is_anchor and not any(c.kind == "eager" and _group(c) == _group(cfg) for c in out):
            out.insert(0, dataclasses.replace(cfg, kind="eager", amb=None, budget=None, budget_bytes=None,
                                              chunks=None, offload=None, stages=1, microbatches=1, compile=False))
    eager = [c for c in out if c.kind == "eager"]
    return eager + [c for c in out if c.kind != "eager"]


def run_grid(configs: list[BenchConfig], rounds: int = 1, timeout: float | None = None, progress=None) -> dict:
    """Run the grid `rounds` times, interleaved.

    Returns:
        {"grid": [config dicts], "rounds": N, "runs": [raw measurement per row and round,
        with "label", "round", "max_grad_diff", "budget_bytes"], "rows": [combined rows]}.
    """
    progress = progress or (lambda line: None)
    configs = with_eager_reference(configs)
    eager_peak: dict = {}
    reference: dict = {}
    runs = []
    with tempfile.TemporaryDirectory(prefix="sppo_bench_") as tmp:
        for k in range(rounds):
            for i, cfg in enumerate(configs):
                tag = f"[round {k + 1}/{rounds}, {i + 1}/{len(configs)}] {cfg.label}"
                try:
                    if cfg.budget is not None and min_headroom(cfg.budget) is None:
                        cfg = dataclasses.replace(cfg, budget_bytes=resolve_budget(cfg.budget, eager_peak.get(_group(cfg))))
                except SppoError as e:
                    runs.append({"label": cfg.label, "round": k, "error": str(e)})
                    progress(f"{tag}: {e}")
                    continue
                progress(f"{tag} ...")
                grads = os.path.join(tmp, f"grads_{i}.pt")
                t = time.perf_counter()
                res = run_row(cfg, grads, timeout)
                res.update(label=cfg.label, round=k)
                res.setdefault("budget_bytes", cfg.budget_bytes)
                if "error" not in res:
                    if cfg.kind == "eager" and _group(cfg) not in reference:
                        import torch
                        eager_peak[_group(cfg)] = res["peak_extra_bytes"]
                        reference[_group(cfg)] = torch.load(grads)
                    res["max_grad_diff"] = _grad_diff(grads, reference.get(_group(cfg)))
                if os.path.exists(grads):
                    os.remove(grads)
                runs.append(res)
                status = res.get("error") or (f"step {res['step_s']:.3f} s, peak extra "
                                              f"{res['peak_extra_bytes'] / 2**20:.0f} MiB")
                progress(f"{tag}: {status} ({time.perf_counter() - t:.0f} s)")
    return {"grid": [c.to_dict() for c in configs], "rounds": rounds, "runs": runs,
            "rows": combine_rounds(configs, runs)}


def combine_rounds(configs: list[BenchConfig], runs: list[dict]) -> list[dict]:
    """One row per configuration (see the module docstring); a row that failed in any
    round is reported failed."""
    rows = []
    for cfg in configs:
        mine = [r for r in runs if r["label"] == cfg.label]
        failed = next((r for r in mine if "error" in r), None)
        row = {"label": cfg.label, "config": cfg.to_dict(), "anchor": cfg.is_anchor}
        if failed or not mine:
            rows.append({**row, "error": failed["error"] if failed else "not run"})
            continue
        diffs = [r.get("max_grad_diff") for r in mine]
        row.update(step_s=statistics.median(r["step_s"] for r in mine),
                   first_s=statistics.median(r["first_s"] for r in mine),
                   peak_extra_bytes=max(r["peak_extra_bytes"] for r in mine),
                   step_by_round=[r["step_s"] for r in mine], peak_by_round=[r["peak_extra_bytes"] for r in mine],
                   loss=mine[0].get("loss"), budget_bytes=mine[0].get("budget_bytes"),
                   max_grad_diff=None if any(d is None for d in diffs) else max(diffs))
        for key in ("predicted_peak_bytes", "predicted_step_s", "predicted_terms", "plan", "gpu", "minimum_budget_bytes",
                    "first_phases"):
            if key in mine[0]:
                row[key] = mine[0][key]
        rows.append(row)
    return rows


def _noise(values: list[float], floor: float) -> float:
    return max(floor, max(values) - min(values)) if values else floor


def add_ratios(rows: list[dict], baseline: str | None) -> tuple[dict | None, list[str]]:
    """Fill each row's ratios to the baseline row (in place); (baseline row, footnotes).

    `baseline` names a row by label ("compile-amb:0.25", "sppo budget=25%") or kind
    ("eager", "compile", "sppo": its first row); None: the first row.

    Sets "time_ratio" (median of the per-round ratios), "time_ratios" (each round's),
    "memory_ratio" (peak / the baseline's peak), and for rows with a prediction
    "peak_vs_predicted" and "time_vs_predicted" (measured / predicted), and "fits_budget".
    """
    ok = [r for r in rows if "error" not in r]
    if baseline is None:
        base = ok[0] if ok else None
    else:
        base = next((r for r in ok if r["label"] == baseline), None) or next(
            (r for r in ok if r["config"]["kind"] == baseline), None)
        if base is None:
            labels = ", ".join(r["label"] for r in rows)
            raise SppoError(f"--baseline {baseline!r} names no row that ran; rows: {labels}")
    notes = []
    for r in ok:
        if base is not None:
            t_noise = NOISE_FLOOR_S
            m_noise = _noise(base["peak_by_round"], NOISE_FLOOR_BYTES)
            per_round = [ratio(a, b, t_noise) for a, b in zip(r["step_by_round"], base["step_by_round"])]
            r["time_ratios"] = per_round
            r["time_ratio"] = None if any(x is None for x in per_round) else statistics.median(per_round)
            r["memory_ratio"] = ratio(r["peak_extra_bytes"], base["peak_extra_bytes"], m_noise)
            if r["time_ratio"] is None and "time" not in notes:
                notes.append("time")
            if r["memory_ratio"] is None and "memory" not in notes:
                notes.append("memory")
        if r.get("predicted_peak_bytes") is not None:
            r["peak_vs_predicted"] = ratio(r["peak_extra_bytes"], r["predicted_peak_bytes"], NOISE_FLOOR_BYTES)
        if r.get("predicted_step_s") is not None:
            r["time_vs_predicted"] = ratio(r["step_s"], r["predicted_step_s"], NOISE_FLOOR_S)
        if r.get("budget_bytes"):
            frac, extra = BUDGET_TOLERANCE
            r["fits_budget"] = r["peak_extra_bytes"] <= r["budget_bytes"] * (1 + frac) + extra
    footnotes = []
    if "memory" in notes:
        footnotes.append(f"– memory ratio: {base['label']}'s peak extra memory "
                         f"({base['peak_extra_bytes'] / 2**20:.1f} MiB) is within noise of zero "
                         f"(≤ {_noise(base['peak_by_round'], NOISE_FLOOR_BYTES) / 2**20:.1f} MiB), so a ratio "
                         "to it means nothing; use a longer sequence or another --baseline")
    if "time" in notes:
        footnotes.append(f"– time ratio: {base['label']}'s step time is within noise of zero "
                         f"(≤ {NOISE_FLOOR_S * 1e3:.1f} ms)")
    return base, footnotes
