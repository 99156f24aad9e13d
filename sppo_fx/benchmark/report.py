"""Tables, JSON and CSV records of a benchmark run, and the comparison of two records."""
from __future__ import annotations

import csv
import json
import os
import platform
import subprocess

from tabulate import tabulate

from sppo_fx.errors import SppoError
from sppo_fx.solver.profile_cache import load_average

DASH = "–"


def _mib(b) -> str:
    if b is None:
        return DASH
    return f"{b / 2**20:.0f}" if abs(b) >= 10 * 2**20 else f"{b / 2**20:.1f}"


def _x(r) -> str:
    return DASH if r is None else f"{r:.2f}"


def _spread(values) -> str:
    vals = [v for v in values or () if v is not None]
    return f" ({min(vals):.2f}..{max(vals):.2f})" if len(vals) > 1 else ""


def format_table(rows: list[dict], baseline: dict | None, footnotes: list[str], fmt: str = "simple") -> str:
    """The results table: measured, ratios to the baseline, predicted beside measured
    (`fmt`: a tabulate format, e.g. "github" for Markdown)."""
    name = baseline["label"] if baseline else "baseline"
    table = []
    for r in rows:
        if "error" in r:
            table.append([r["label"], "failed: " + r["error"][:70]] + [""] * 10)
            continue
        pred = "predicted_peak_bytes" in r or "predicted_step_s" in r
        fits = r.get("fits_budget")
        budget = DASH if not r.get("budget_bytes") else f"{_mib(r['budget_bytes'])} ({'yes' if fits else 'NO'})"
        diff = r.get("max_grad_diff")
        table.append([
            r["label"], f"{r['step_s']:.3f}", _x(r.get("time_ratio")) + _spread(r.get("time_ratios")),
            _mib(r["peak_extra_bytes"]), _x(r.get("memory_ratio")), f"{r['first_s']:.1f}", budget,
            _mib(r.get("predicted_peak_bytes")) if pred else "",
            _x(r.get("peak_vs_predicted")) if pred else "",
            (DASH if r.get("predicted_step_s") is None else f"{r['predicted_step_s']:.3f}") if pred else "",
            _x(r.get("time_vs_predicted")) if pred else "",
            DASH if diff is None else f"{diff:.1e}"])
    headers = ["configuration", "step s", f"vs {name}", "peak extra MiB", f"vs {name}", "first call s",
               "budget MiB (fits)", "pred. peak MiB", "meas/pred", "pred. step s", "meas/pred",
               "max grad diff vs eager"]
    text = tabulate(table, headers=headers, tablefmt=fmt, disable_numparse=True)
    notes = list(footnotes)
    if any(r.get("time_ratios") and len(r["time_ratios"]) > 1 for r in rows):
        notes.append(f"vs {name}: median of the per-round ratios (min..max over rounds); peak: the largest round")
    if any(r.get("budget_bytes") for r in rows if "error" not in r):
        notes.append("fits: measured peak <= budget + 10% + 16 MiB (RSS also holds what no plan controls)")
    if any("predicted_peak_bytes" in r and r["predicted_peak_bytes"] is None for r in rows):
        notes.append("pred. –: pipeline plans predict their step time only (per-rank peaks are not modelled)")
    return text + "".join("\n" + n for n in notes)


def accuracy(rows: list[dict]) -> dict:
    """How far the plans' predictions are from what ran: over the rows with a prediction,
    the median and the worst |log(predicted / measured)| of step time and of peak memory,
    and the row of the worst (|log| is symmetric: 2x too slow and 2x too fast count the
    same; exp of it is the factor). Rows whose measured value is within noise of zero are
    left out (their ratio means nothing)."""
    import math
    import statistics
    from sppo_fx.benchmark.engine import NOISE_FLOOR_BYTES, NOISE_FLOOR_S
    out = {}
    for what, pred, meas, noise in (("step", "predicted_step_s", "step_s", NOISE_FLOOR_S),
                                    ("peak", "predicted_peak_bytes", "peak_extra_bytes", NOISE_FLOOR_BYTES)):
        errs = [(abs(math.log(r[pred] / r[meas])), r["label"]) for r in rows
                if "error" not in r and r.get(pred) and r.get(meas) is not None and r[meas] > noise and r[pred] > 0]
        if not errs:
            continue
        worst = max(errs)
        out[what] = {"rows": len(errs), "median_abs_log": statistics.median(e for e, _ in errs),
                     "worst_abs_log": worst[0], "worst_row": worst[1]}
    return out


def format_accuracy(acc: dict) -> str:
    """One line per measure of `accuracy`, e.g. "step: median |log(pred/meas)| 0.08 (x1.08),
    worst 0.22 (x1.25, sppo budget=min) over 6 rows"."""
    import math
    lines = []
    for what, a in acc.items():
        lines.append(f"prediction accuracy, {what}: median |log(pred/meas)| {a['median_abs_log']:.3f} "
                     f"(x{math.exp(a['median_abs_log']):.2f}), worst {a['worst_abs_log']:.3f} "
                     f"(x{math.exp(a['worst_abs_log']):.2f}, {a['worst_row']}) over {a['rows']} row(s)")
    return "\n".join(lines)


def machine() -> dict:
    """CPU model, cores, GPU, torch and Triton versions of this machine."""
    import torch
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "gpu": gpu, "torch": torch.__version__,
            "triton": triton_version, "python": platform.python_version(), "load_average_1min": load_average()}


def commit() -> str | None:
    """The git commit of the sppo_fx checkout (with "+dirty" for uncommitted changes)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+dirty" if dirty else "")) or None


def write_records(result: dict, out_dir: str) -> tuple[str, str]:
    """bench.json (grid, machine, commit, raw per-round runs, combined rows) and bench.csv
    (one line per row); their paths."""
    os.makedirs(out_dir, exist_ok=True)
    json_path, csv_path = os.path.join(out_dir, "bench.json"), os.path.join(out_dir, "bench.csv")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    flat = []
    for r in result["rows"]:
        line = {k: v for k, v in r.items() if not isinstance(v, (dict, list))}
        line.update({f"config.{k}": v for k, v in r["config"].items()})
        flat.append(line)
    keys = sorted({k for line in flat for k in line})
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(flat)
    return json_path, csv_path


def load_record(path: str) -> dict:
    """A bench.json written by `write_records` (or a directory holding one)."""
    if os.path.isdir(path):
        path = os.path.join(path, "bench.json")
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SppoError(f"cannot read benchmark record {path}: {e}") from None
    if not isinstance(record, dict) or "rows" not in record:
        raise SppoError(f"{path} is not a record of `sppo-fx bench --out` (no 'rows')")
    return record


def compare(before: dict, after: dict) -> str:
    """Rows present in both records, with after / before ratios of step time and peak."""
    from sppo_fx.benchmark.engine import NOISE_FLOOR_BYTES, NOISE_FLOOR_S, ratio
    old = {r["label"]: r for r in before["rows"] if "error" not in r}
    table = []
    for r in after["rows"]:
        o = old.get(r["label"])
        if o is None or "error" in r:
            continue
        table.append([r["label"], f"{o['step_s']:.3f}", f"{r['step_s']:.3f}",
                      _x(ratio(r["step_s"], o["step_s"], NOISE_FLOOR_S)), _mib(o["peak_extra_bytes"]),
                      _mib(r["peak_extra_bytes"]), _x(ratio(r["peak_extra_bytes"], o["peak_extra_bytes"],
                                                            NOISE_FLOOR_BYTES))])
    if not table:
        raise SppoError("the two records share no row that ran in both: compare runs of the same grid")
    head = (f"before: commit {before.get('commit')}, {before.get('machine', {}).get('cpu')}\n"
            f"after:  commit {after.get('commit')}, {after.get('machine', {}).get('cpu')}\n")
    return head + tabulate(table, headers=["configuration", "step s before", "after", "after/before",
                                           "peak MiB before", "after", "after/before"], disable_numparse=True)
