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
(every row, the accuracy, the commands, failures, and the device profiles the rows were
predicted with: a calibration made under load shows there), clock-grid.png (needs
matplotlib, the `plot` extra; skipped with a note without it).

    python bench/clock_grid.py --attention --out /tmp/attn    # the attention term alone

`--attention` times the chunk attention ops (forward op, backward op, process CPU time) at
the shapes of few- and many-chunk plans of the grid's models, against the clock's attention
term from a calibration made just before in the same process, per round: the per-dim,
size and square tables ("new") and the line e + d·f alone ("old").
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import types

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


#: (label, (heads, head dim, layers), chunk lengths): plans of the grid's models
ATTENTION_ROWS = (("tiny T=1024 (4)", (4, 8, 2), (443, 238, 186, 157)),
                  ("tiny T=8192 (4)", (4, 8, 2), (4096, 1697, 1302, 1097)),
                  ("small T=2048 (4)", (8, 32, 4), (800, 500, 400, 348)),
                  ("small T=4096 (4)", (8, 32, 4), (1593, 1010, 804, 689)),
                  ("bench T=1024 (4)", (12, 64, 16), (443, 238, 186, 157)),
                  ("small T=4096 (16)", (8, 32, 4), (256,) * 16),
                  ("tiny T=1024 (64)", (4, 8, 2), (16,) * 64))


def attention_rows(rounds: int = 2) -> list[dict]:
    """Measured / predicted attention seconds of `ATTENTION_ROWS`, old and new clock."""
    import torch
    from sppo_fx.solver import clock_calibration as cc
    from sppo_fx.solver.clock import Clock, attention_seconds
    from sppo_fx.solver.partition import ChunkCostModel
    dev, out = torch.device("cpu"), []
    timer = cc.compute_timer(dev)
    for rnd in range(rounds):
        e, f, by_dim, square, size = cc.attention_figures(dev, 0.25)
        call = cc.attention_call_seconds(dev, 0.05)
        old = Clock(attention_pair_seconds=e, attention_pair_dim_seconds=f, attention_call_seconds=call)
        new = Clock.of(types.SimpleNamespace(attention_pair_seconds=e, attention_pair_dim_seconds=f,
                                             attention_call_seconds=call, attention_by_dim=by_dim,
                                             attention_square=square, attention_size=size))
        print(f"round {rnd}: per pair and head (ns) {[(d, round(x * 1e9, 2)) for d, x in by_dim]}, "
              f"square {square}, size {size}", flush=True)
        for label, (h, d, layers), lengths in ATTENTION_ROWS:
            cost = ChunkCostModel(per_token=0, per_pair=0, attention=((h, d),) * layers)
            starts = [sum(lengths[:i]) for i in range(len(lengths))]
            meas = sum(layers * cc._best(cc._attention_pass(dev, c, t, d, h), 1, 0.0, timer)
                       for c, t in zip(lengths, starts))
            pred = {name: sum(attention_seconds(cost, c, t, clock) + layers * call for c, t in zip(lengths, starts))
                    for name, clock in (("old", old), ("new", new))}
            out.append(dict(round=rnd, label=label, measured_s=meas, **{f"{k}_s": v for k, v in pred.items()}))
            print(f"  {label:18s} measured {meas:.3f} s, meas/pred old {meas / pred['old']:.2f}, "
                  f"new {meas / pred['new']:.2f}", flush=True)
    return out


def _profiles() -> list[dict]:
    """The device profiles stored in this process's profile cache (the rows' predictions)."""
    from sppo_fx.solver.profile_cache import cache_dir
    found = []
    try:
        for name in sorted(os.listdir(cache_dir())):
            with open(os.path.join(cache_dir(), name)) as f:
                found.append(json.load(f))
    except (OSError, json.JSONDecodeError):
        pass
    return found


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
    p.add_argument("--attention", action="store_true", help="the attention term alone at the plans' shapes")
    args = p.parse_args(argv)
    if args.attention:
        os.makedirs(args.out, exist_ok=True)
        record = {"command": " ".join([sys.executable, *sys.argv]), "load_average": os.getloadavg(),
                  "rows": attention_rows()}
        with open(os.path.join(args.out, "attention-rows.json"), "w") as f:
            json.dump(record, f, indent=1)
        return 0
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
    record = {"command": " ".join([sys.executable, *sys.argv]), "runs": runs, "rows": rows, "accuracy": acc,
              "profiles": _profiles()}
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
