"""`sppo-fx bench`: a grid of anchors and pass configurations, each row in its own process.

    sppo-fx bench --size small --seq-len 1024 --anchors eager,compile,compile-amb:0.25,checkpoint \\
                  --budget 50%,25%,min --baseline eager --rounds 2 --out results --plot results/pareto.png
    sppo-fx bench --chunks 0,4,8 --offload none,disk --stages 1,2 --compile off,on    # former grid
    sppo-fx bench --compare before/bench.json after/bench.json
    sppo-fx bench --replot results/bench.json --plot pareto.png      # redraw a record's picture

Every library axis takes a comma list and the grid is their product (plus the anchors);
`--only axis=v[|v],axis=v` keeps the rows matching any --only, `--skip` drops matching
rows (axes: kind, label and the axis names below). `--chunks 0` is the eager anchor.
"""
from __future__ import annotations

import argparse
import sys

from sppo_fx.benchmark import config as cfgmod
from sppo_fx.benchmark.config import BenchConfig, build_grid
from sppo_fx.errors import SppoError

AXIS_HELP = {
    "budget": "none | N%% of eager's measured peak extra memory | bytes such as 2GiB | min (the solver's "
              "smallest feasible) | min+P%% (P%% above it: the fastest plan within that headroom)",
    "chunks": "sequence chunks, or auto (library default; the solver's choice under a budget); 0 = eager",
    "partition": "balanced | even", "recompute": "auto | none | cheap | full", "skeleton": "auto | keep | offload",
    "offload": "none | disk | host | device (under a budget, none means the library's default tier)",
    "stages": "pipeline stages (local ranks)", "microbatches": "micro-batches per step",
    "schedule": "1f1b | gpipe", "compile": "on | off: Inductor for the chunk programs",
    "dtype": "fp32 | bf16 (anchors too)", "device": "cpu | cuda (anchors too)"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=["gpt", "llama"], default="llama")
    p.add_argument("--size", default="tiny", help="model preset: tiny | small | bench")
    from sppo_fx.util.units import positive_int
    p.add_argument("--seq-len", type=positive_int, default=256)
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--steps", type=positive_int, default=2, help="timed steps per row after the first call")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="run the grid this many times, interleaved; ratios are medians of per-round ratios")
    p.add_argument("--anchors", default="eager",
                   help="comma list of eager, compile, compile-amb:F, checkpoint (or none)")
    defaults = dict(cfgmod.LIBRARY_AXES + cfgmod.COMMON_AXES)
    defaults["chunks"] = "4"
    for name in cfgmod.AXES:
        p.add_argument(f"--{name}", default=defaults[name], help=f"comma list: {AXIS_HELP[name]} "
                                                                f"(default {defaults[name]})")
    p.add_argument("--only", action="append", default=[], help="keep rows matching axis=v[|v],...")
    p.add_argument("--skip", action="append", default=[], help="drop rows matching axis=v[|v],...")
    p.add_argument("--baseline", default=None,
                   help="row the ratios are to: a kind (eager, compile, checkpoint, sppo) or a label "
                        "(default: the first row)")
    p.add_argument("--out", default=None, help="directory for bench.json and bench.csv")
    p.add_argument("--plot", default=None,
                   help="picture of step time vs peak memory (needs matplotlib: pip install 'sppo_fx[plot]'): "
                        "x.png (PNG + x.svg beside it), x.svg or x.pdf")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), default=None,
                   help="print the ratio table between two bench.json records and exit")
    p.add_argument("--replot", nargs="+", metavar="RECORD", default=None,
                   help="draw --plot from bench.json records instead of running (rows of later records "
                        "whose label an earlier one has are left out)")
    p.add_argument("--title", default=None, help="the picture's title (default: the grid's model and size)")
    p.add_argument("--timeout", type=_seconds, default=1800, help="seconds each row may take")
    p.add_argument("--offload-dir", type=_directory, default=None,
                   help="directory of the disk tier (default: system temp)")


def _seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    import math
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number of seconds > 0")
    return value


def _directory(text: str) -> str:
    """argparse type: an existing directory."""
    import os
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an existing directory: create it or give another")
    return text


def configs_from_args(args: argparse.Namespace) -> list[BenchConfig]:
    base = BenchConfig(model=args.model, size=args.size, seq_len=args.seq_len, batch=args.batch, steps=args.steps,
                       offload_dir=args.offload_dir)
    anchors = [] if args.anchors.strip() in ("", "none") else cfgmod.split_list(args.anchors)
    axes = {name: getattr(args, name) for name in cfgmod.AXES}
    return build_grid(base, anchors, axes, only=args.only, skip=args.skip)


def run(args: argparse.Namespace, progress=None) -> dict:
    """Run the grid the arguments describe; print table and text plot; write the records.
    Returns the record (also what bench.json holds)."""
    from sppo_fx.benchmark import plot, report
    from sppo_fx.benchmark.engine import add_ratios, run_grid
    from sppo_fx.solver.profile_cache import load_average
    if args.rounds < 1 or args.steps < 1:
        raise SppoError("--rounds and --steps must be at least 1")
    configs = configs_from_args(args)
    if args.plot:
        plot.require_matplotlib()
    # the commit and load the rows start from: a long grid outlives edits and other jobs
    machine, head = report.machine(), report.commit()
    result = run_grid(configs, rounds=args.rounds, timeout=args.timeout, progress=progress)
    machine["load_average_1min_end"] = load_average()
    base, notes = add_ratios(result["rows"], args.baseline)
    result.update(machine=machine, commit=head, baseline=base and base["label"], command=" ".join(sys.argv),
                  accuracy=report.accuracy(result["rows"]))
    written = list(report.write_records(result, args.out)) if args.out else []  # before anything can fail
    title = (f"{args.model}-{args.size}, T={args.seq_len}, batch {args.batch}, {args.steps} steps x "
             f"{args.rounds} round(s)")
    m = result["machine"]
    print(f"\nsppo_fx bench: {title}; {m['cpu']} ({m['cores']} cores, load {m['load_average_1min']})"
          + (f", {m['gpu']}" if m["gpu"] else "") + f"; torch {m['torch']}; commit {result['commit']}")
    print(report.format_table(result["rows"], base, notes))
    if result["accuracy"]:
        print(report.format_accuracy(result["accuracy"]))
    points = plot.points_of(result["rows"])
    print("\nstep time vs peak extra memory:\n" + plot.text_plot(points))
    if args.plot and points:
        written += plot.write_picture(points, args.plot, args.title or title)
    for path in written:
        print(f"wrote {path}")
    return result


def replot(args: argparse.Namespace) -> int:
    """Draw the picture of recorded runs (`--replot`), without running anything."""
    from sppo_fx.benchmark import plot
    if not args.plot:
        raise SppoError("--replot draws a picture: give its file with --plot x.png (or x.svg, x.pdf)")
    points = plot.points_of_records(args.replot)
    print(plot.text_plot(points))
    for path in plot.write_picture(points, args.plot, args.title or ""):
        print(f"wrote {path}")
    return 0


def main(args: argparse.Namespace) -> int:
    from sppo_fx.benchmark import report
    try:
        if args.replot:
            return replot(args)
        if args.compare:
            print(report.compare(report.load_record(args.compare[0]), report.load_record(args.compare[1])))
            return 0
        result = run(args, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except SppoError as e:
        print(f"sppo-fx bench: {e}", file=sys.stderr)
        return 2
    return 1 if any("error" in r for r in result["rows"]) else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
