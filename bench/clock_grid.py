"""The solver clock's accuracy grid: `sppo-fx bench` over models x sequence lengths, budgets
none, 50%, 25%, min+10%, min, tiers disk and host, each (model, T) in its own bench run;
one merged record with every row's predicted / measured step and peak, the predicted
step's terms, and the accuracy summary (median and worst |log(predicted / measured)|,
`benchmark.report.accuracy`), and the picture of predicted against measured step.

    python bench/clock_grid.py --out /tmp/clock_grid                     # the default grid
    python bench/clock_grid.py --grid tiny:1024 --out /tmp/clock_small   # a subset

The default grid covers the three models and T = 1024..8192 without their full product
(tiny at 1024 and 8192, small at 2048 and 4096, bench at 1024: 5 x 11 rows, eager included;
chunk programs op by op, `--compile off`, so that no row spends minutes in Inductor). On an
idle 2-core machine it is estimated at 30-40 minutes (rows measured on a loaded one took
20-140 s, most of it the first call). Every row has `--timeout` seconds (default 300): a row
that runs out, or a (model, T) whose bench fails as a whole, is recorded with its error and
the grid goes on.

Writes under --out: one folder per (model, T) (`sppo-fx bench`'s records), clock-grid.json
(every row, the accuracy, the commands, failures), clock-grid.png (needs matplotlib, the
`plot` extra; skipped with a note without it).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

DEFAULT_GRID = "tiny:1024,tiny:8192,small:2048,small:4096,bench:1024"


def _bench(size: str, seq: str, args, out: str) -> tuple[list[dict], dict]:
    """Rows and run record of one (model, T); a failed run gives one error row."""
    cmd = [sys.executable, "-m", "sppo_fx", "bench", "--size", size, "--seq-len", seq, "--anchors", "eager",
           "--chunks", "auto", "--budget", args.budget, "--offload", args.offload, "--compile", args.compile,
           "--steps", args.steps, "--rounds", args.rounds, "--timeout", args.timeout, "--baseline", "eager",
           "--out", out]
    print(" ".join(cmd), flush=True)
    t0 = time.perf_counter()
    try:
        rc = subprocess.run(cmd, check=False).returncode
    except OSError as e:
        rc = f"could not start: {e}"
    run = {"size": size, "seq_len": int(seq), "command": " ".join(cmd), "seconds": round(time.perf_counter() - t0)}
    try:
        with open(os.path.join(out, "bench.json")) as f:
            record = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        run["error"] = f"bench exited {rc}, no record ({e})"
        return [{"label": f"{size} T={seq}", "error": run["error"]}], run
    run.update(commit=record.get("commit"), machine=record.get("machine"))
    rows = []
    for r in record["rows"]:
        r = dict(r, label=f"{size} T={seq} {r['label']}")
        raw = next((x for x in record.get("runs", ()) if x.get("label") == r["label"].split(" ", 2)[2]), {})
        r.setdefault("predicted_terms", raw.get("predicted_terms"))
        rows.append(r)
    return rows, run


def _line(r: dict) -> str:
    if "error" in r:
        return f"{r['label']}: failed: {r['error'][:100]}"
    pred = r.get("predicted_step_s")
    terms = r.get("predicted_terms") or {}
    ratio = f" meas/pred {r['step_s'] / pred:.2f}" if pred else ""
    detail = " (" + ", ".join(f"{k} {v:.3g}" for k, v in terms.items()) + ")" if terms else ""
    return (f"{r['label']}: step {r['step_s']:.3f} s" + (f", predicted {pred:.3f} s" if pred else "")
            + ratio + detail)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", default=DEFAULT_GRID, help="comma list of size:T")
    p.add_argument("--budget", default="none,50%,25%,min+10%,min")
    p.add_argument("--offload", default="disk,host")
    p.add_argument("--compile", default="off")
    p.add_argument("--steps", default="2")
    p.add_argument("--rounds", default="1")
    p.add_argument("--timeout", default="300", help="seconds per row (a row that runs out is recorded failed)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from sppo_fx.benchmark.report import accuracy, format_accuracy
    os.makedirs(args.out, exist_ok=True)
    rows, runs = [], []
    for item in args.grid.split(","):
        size, seq = item.strip().split(":")
        got, run = _bench(size, seq, args, os.path.join(args.out, f"{size}-{seq}"))
        rows += got
        runs.append(run)
    acc = accuracy(rows)
    inside = [0.8 <= r["step_s"] / r["predicted_step_s"] <= 1.25 for r in rows
              if "error" not in r and r.get("predicted_step_s")]
    acc["step_rows_within_0.8_1.25"] = f"{sum(inside)}/{len(inside)}"
    record = {"command": " ".join([sys.executable, *sys.argv]), "runs": runs, "rows": rows, "accuracy": acc}
    with open(os.path.join(args.out, "clock-grid.json"), "w") as f:
        json.dump(record, f, indent=1)
    print("\n" + "\n".join(_line(r) for r in rows))
    print(format_accuracy({k: v for k, v in acc.items() if isinstance(v, dict)}))
    print(f"rows with measured/predicted step in 0.8..1.25: {acc['step_rows_within_0.8_1.25']}")
    try:
        from sppo_fx.benchmark.plot import write_accuracy_picture
        step = acc.get("step")
        title = ("solver clock: predicted vs measured step" + (
            f" (median x{math.exp(step['median_abs_log']):.2f}, worst x{math.exp(step['worst_abs_log']):.2f})"
            if step else ""))
        for path in write_accuracy_picture(rows, os.path.join(args.out, "clock-grid.png"), title):
            print(f"picture: {path}")
    except Exception as e:  # noqa: BLE001 - the record is written; a missing matplotlib must not lose it
        print(f"no picture: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
