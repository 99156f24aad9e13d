"""The solver clock's accuracy grid: `sppo-fx bench` over models x sequence lengths, budgets
none, 50%, 25%, min+10%, min, tiers disk and host, each (model, T) in its own bench run;
one merged record with every row's predicted / measured step and peak and the accuracy
summary (median and worst |log(predicted / measured)|, `benchmark.report.accuracy`).

    python bench/clock_grid.py --out /tmp/clock_grid                  # the full grid
    python bench/clock_grid.py --grid tiny:1024 --out /tmp/clock_small   # a subset

The default grid (tiny at 1024..8192, small at 1024 and 2048, bench at 1024; chunk programs
op by op, `--compile off`, so that no row spends minutes in Inductor) is sized to finish in
about 40 minutes on an idle 2-core machine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

DEFAULT_GRID = "tiny:1024,tiny:2048,tiny:4096,tiny:8192,small:1024,small:2048,bench:1024"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", default=DEFAULT_GRID, help="comma list of size:T")
    p.add_argument("--budget", default="none,50%,25%,min+10%,min")
    p.add_argument("--offload", default="disk,host")
    p.add_argument("--compile", default="off")
    p.add_argument("--steps", default="2")
    p.add_argument("--rounds", default="1")
    p.add_argument("--timeout", default="900")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from sppo_fx.benchmark.report import accuracy, format_accuracy
    rows, runs = [], []
    for item in args.grid.split(","):
        size, seq = item.split(":")
        out = os.path.join(args.out, f"{size}-{seq}")
        cmd = [sys.executable, "-m", "sppo_fx", "bench", "--size", size, "--seq-len", seq, "--anchors", "eager",
               "--chunks", "auto", "--budget", args.budget, "--offload", args.offload, "--compile", args.compile,
               "--steps", args.steps, "--rounds", args.rounds, "--timeout", args.timeout, "--baseline", "eager",
               "--out", out]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=False)
        try:
            with open(os.path.join(out, "bench.json")) as f:
                record = json.load(f)
        except OSError:
            continue
        for r in record["rows"]:
            r["label"] = f"{size} T={seq} {r['label']}"
            rows.append(r)
        runs.append({"size": size, "seq_len": int(seq), "command": record.get("command"),
                     "commit": record.get("commit"), "machine": record.get("machine")})
    acc = accuracy(rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "clock-grid.json"), "w") as f:
        json.dump({"command": " ".join([sys.executable, *sys.argv]), "runs": runs, "rows": rows, "accuracy": acc},
                  f, indent=1)
    print("\n" + "\n".join(f"{r['label']}: step {r.get('step_s', float('nan')):.3f} s predicted "
                           f"{r.get('predicted_step_s') or float('nan'):.3f} s" for r in rows if "error" not in r))
    print(format_accuracy(acc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
