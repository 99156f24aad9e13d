"""What fresh pages cost inside a training step, against what the clock's allocation probe
says they cost (`solver.calibration.allocation_prices`, the allocation term).

The benchmark runs its workers with glibc's mmap threshold fixed at 128 KiB
(`benchmark.engine.BENCH_MALLOC_ENV`, so that RSS follows live tensors): every larger tensor
then gets fresh pages from the kernel. Under glibc's defaults the same tensors mostly reuse
memory the process already holds. This script runs the same steps in child processes of
both kinds, alternating, and reports per step: time, fresh pages faulted (`getrusage`
minor faults) and system time; then what a GiB of fresh pages added to the step,

    in-step price = (step with fresh pages - step without) / (faults with - faults without)

beside the probe's table measured in the same benchmark-settings processes.

    python bench/fresh_pages.py --out /tmp/fresh_pages.json
    python bench/fresh_pages.py --size small --seq-len 2048 --budget 52MiB --rounds 3

Rows: eager (the model's own forward and backward), and with `--budget` or `--chunks` an
sppo plan run op by op (`compile=False`) with the disk tier, its predicted terms beside it
(each process calibrates for itself: under glibc's defaults the probe reads about 0).
Each process times `--steps` steps after one warm-up and keeps their median; the record
keeps every process's figures. On the 2-core test machine a process pair takes about a
minute for the bench model at T = 1024.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2 ** 30
#: fewer extra faulted bytes than this give no price: the steps' difference would be noise
MIN_EXTRA_BYTES = 64 << 20


def _worker(args) -> None:
    """One process: the probe's table, then each row's steps (stdout: one JSON line)."""
    import resource

    import torch
    import sppo_fx
    from sppo_fx.benchmark.calibration import bench_model_and_data
    from sppo_fx.solver.calibration import allocation_prices
    from sppo_fx.util.units import parse_bytes

    model, (x, y) = bench_model_and_data(args.model, args.size, 1, args.seq_len)
    steps = {"eager": lambda: model(x, y).backward()}
    out: dict = {"malloc": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}, "rows": {}}
    offload_dir = tempfile.TemporaryDirectory(prefix="sppo_fresh_pages_")  # removed at exit
    if args.budget is not None or args.chunks is not None:
        kw = dict(budget=parse_bytes(args.budget, "budget")) if args.budget is not None else dict(chunks=args.chunks)
        compiled = sppo_fx.compile(model, compile=False, offload="disk", offload_dir=offload_dir.name, **kw)
        steps["sppo"] = lambda: compiled.step(x, y)
    probe = allocation_prices(torch.device("cpu"), 0.1)
    out["probe_s_per_gib"] = [[n, p * GiB] for n, p in probe]
    for name, step in steps.items():
        samples = []
        for i in range(args.steps + 1):
            model.zero_grad(set_to_none=True)
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t = time.perf_counter()
            step()
            wall = time.perf_counter() - t
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            if i:  # the first step warms the caches and the heap
                samples.append((wall, (r1.ru_minflt - r0.ru_minflt) * resource.getpagesize(),
                                r1.ru_stime - r0.ru_stime))
        row = {key: statistics.median(s[j] for s in samples) for j, key in enumerate(("step_s", "fault_bytes", "sys_s"))}
        if name == "sppo":
            from sppo_fx.benchmark.worker import _terms
            row["plan"] = str(compiled.plan).splitlines()[-1]
            row["chunk_lengths"] = list(compiled.plan.chunk_lengths)
            row["predicted_s"] = compiled.predicted()[1]
            row["predicted_terms"] = _terms(compiled)
        out["rows"][name] = row
    print(json.dumps(out))


def worker_env(fresh: bool, base=None) -> dict:
    """A worker's environment: with the benchmark's glibc settings over the rest, as the
    engine's workers run (`fresh`), or with none of glibc's `MALLOC_*` settings and tunables
    (its defaults)."""
    from sppo_fx.benchmark.engine import BENCH_MALLOC_ENV
    env = dict(os.environ if base is None else base)
    if fresh:
        return dict(env, **BENCH_MALLOC_ENV)
    return {k: v for k, v in env.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}


def _run(args, fresh: bool) -> dict:
    env = worker_env(fresh)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", args.model, "--size", args.size,
           "--seq-len", str(args.seq_len), "--steps", str(args.steps)]
    cmd += ["--budget", args.budget] if args.budget is not None else []
    cmd += ["--chunks", str(args.chunks)] if args.chunks is not None else []
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout:g} s"}
    lines = res.stdout.strip().splitlines()
    if res.returncode or not lines:
        return {"error": (res.stderr.strip().splitlines() or [f"exit code {res.returncode}"])[-1]}
    return json.loads(lines[-1])


def summarize(runs: dict) -> dict:
    """Per row: the medians over processes of each kind, and the in-step price of a GiB of
    fresh pages; the probe's table (medians over the benchmark-settings processes)."""
    out: dict = {"rows": {}}
    for name in runs["fresh"][0]["rows"]:
        med = {kind: {k: statistics.median(r["rows"][name][k] for r in runs[kind])
                      for k in ("step_s", "fault_bytes", "sys_s")} for kind in ("fresh", "default")}
        extra = med["fresh"]["fault_bytes"] - med["default"]["fault_bytes"]
        # a plan is solved per process (its profile calibrated there): a price compares
        # steps of one plan only
        plans = {json.dumps(r["rows"][name].get("chunk_lengths")) for kind in runs for r in runs[kind]}
        row = {"benchmark_settings": med["fresh"], "glibc_defaults": med["default"],
               "in_step_s_per_gib": (med["fresh"]["step_s"] - med["default"]["step_s"]) / (extra / GiB)
               if extra >= MIN_EXTRA_BYTES and len(plans) == 1 else None}
        for kind, key in (("fresh", "benchmark_settings"), ("default", "glibc_defaults")):
            first = runs[kind][0]["rows"][name]
            if "predicted_s" in first:
                row[key]["predicted_s"] = statistics.median(r["rows"][name]["predicted_s"] for r in runs[kind])
                row[key].update(predicted_terms=first["predicted_terms"], plan=first["plan"],
                                chunk_lengths=first.get("chunk_lengths"))
            steps = [r["rows"][name]["step_s"] for r in runs[kind]]
            if max(steps) > 1.5 * min(steps):
                row.setdefault("warnings", []).append(
                    f"{key}: steps of its processes spread {min(steps):.2f}-{max(steps):.2f} s (the machine's "
                    f"spread, not the settings': the price is not reliable)")
        out["rows"][name] = row
    tables = [r["probe_s_per_gib"] for r in runs["fresh"]]
    out["probe_s_per_gib"] = [[size, statistics.median(t[i][1] for t in tables)] for i, (size, _) in enumerate(tables[0])]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama")
    p.add_argument("--size", default="bench")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3, help="timed steps per process (after one warm-up)")
    p.add_argument("--rounds", type=int, default=3, help="process pairs, alternating the two settings")
    p.add_argument("--budget", default=None, help="also an sppo plan at this budget ('500MiB')")
    p.add_argument("--chunks", type=int, default=None, help="also an sppo plan of this many chunks")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a worker process may take")
    p.add_argument("--out", default=None, help="write the record (JSON) here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    if args.worker:
        return _worker(args)
    if args.budget is not None and args.chunks is not None:
        p.error("give --budget or --chunks, not both")
    if args.budget is not None:
        from sppo_fx.errors import SppoError
        from sppo_fx.util.units import parse_bytes
        try:
            parse_bytes(args.budget, "budget")
        except SppoError as e:
            p.error(str(e))
    runs: dict = {"fresh": [], "default": []}
    for r in range(args.rounds):
        for fresh in (True, False):
            got = _run(args, fresh)
            if "error" in got:  # what finished is kept
                print(f"round {r + 1}: a worker failed: {got['error']}", flush=True)
                return _report(args, runs, got["error"])
            runs["fresh" if fresh else "default"].append(got)
            last = got["rows"]
            print(f"round {r + 1} {'benchmark settings' if fresh else 'glibc defaults   '}: " + "; ".join(
                f"{n} {row['step_s']:.2f} s, {row['fault_bytes'] / GiB:.2f} GiB faulted" for n, row in last.items()),
                flush=True)
    _report(args, runs)


def _report(args, runs: dict, error: str | None = None) -> None:
    """Print the prices (where both kinds of process ran) and write the record."""
    summary = summarize(runs) if runs["fresh"] and runs["default"] else {}
    for name, row in summary.get("rows", {}).items():
        price = row["in_step_s_per_gib"]
        print(f"{name}: in-step price of fresh pages {price:.3f} s/GiB" if price is not None else
              f"{name}: no price (under {MIN_EXTRA_BYTES >> 20} MiB more pages faulted under the benchmark's "
              f"settings, or plans differed)")
        for warning in row.get("warnings", ()):
            print(f"  warning: {warning}")
    if summary:
        print("probe (benchmark settings), s/GiB by block size: " + ", ".join(
            f"{size >> 10} KiB {price:.3f}" for size, price in summary["probe_s_per_gib"]))
    if args.out:
        record = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "args": vars(args),
                  "runs": runs, **summary, **({"error": error} if error else {})}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
