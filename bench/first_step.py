"""Time to the first training step: sppo_fx with a budget next to torch.compile and eager.

    python bench/first_step.py [--size small --seq-len 1024 --fraction 0.3]

Each configuration runs in its own process, so every one pays its own imports, tracing and
compiling, as a user's first run does:

    eager            the model as written (its peak extra memory sets the budget)
    torch.compile    torch.compile(model), Inductor cache empty
    torch.compile 2  a second process on the same Inductor cache
    sppo budget      sppo_fx.compile(model, budget=fraction x eager's peak), Inductor cache and
                     device-profile and memory-model caches empty
    sppo budget 2    a second process on the same caches (stored device profile and memory
                     model, Inductor's FX graph and AOTAutograd caches)

"first step" is the first forward + backward, from the compile call to the end of
backward; "import" is `import torch` (and sppo_fx) in that process, before it. For the sppo
rows the first step is broken down by phase (`sppo_fx.util.log.record_phases`; the same phases
the progress lines print); "other" is the time no phase covers (running the step itself,
Python). The caches live in a temporary directory removed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIGS = ["eager", "torch.compile", "torch.compile 2", "sppo budget", "sppo budget 2"]


def worker(args) -> None:
    t0 = time.perf_counter()
    import torch
    sys.path.insert(0, ROOT)
    import sppo_fx
    from sppo_fx.util.rss import rss_bytes  # the benchmark's workers' reader (a fresh process: no free heap to give back)
    from sppo_fx.util.log import enable, record_phases, summarize
    from sppo_fx.models import build
    import_s = time.perf_counter() - t0  # nothing at this module's top imports torch
    enable()  # progress on stderr
    torch.manual_seed(0)
    model = build(args.model, args.size)
    v = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, v, (1, args.seq_len), generator=gen)
    y = torch.randint(0, v, (1, args.seq_len), generator=gen)
    kind = args.config.rstrip(" 2")
    out = {"config": args.config, "import_s": import_s}
    base = rss_bytes("VmRSS", strict=True)
    with record_phases() as phases:
        t = time.perf_counter()
        if kind == "eager":
            model(x, y).backward()
        elif kind == "torch.compile":
            torch.compile(model)(x, y).backward()
        else:
            compiled = sppo_fx.compile(model, budget=args.budget)
            compiled(x, y).backward()
            out["plan"] = str(compiled.plan).splitlines()[-1]
        first = time.perf_counter() - t
    out.update(first_s=first, phases=summarize(phases, first) if phases else [],
               peak_extra=rss_bytes("VmHWM", strict=True) - base)
    print(json.dumps(out))


def _run(args, config: str, cache: str, budget: int | None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--config", config, "--model", args.model,
           "--size", args.size, "--seq-len", str(args.seq_len)]
    if budget is not None:
        cmd += ["--budget", str(budget)]
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from sppo_fx.benchmark.engine import BENCH_MALLOC_ENV  # the benchmark's glibc settings, as its rows run
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
               SPPO_FX_CACHE_DIR=os.path.join(cache, "sppo_fx"), **BENCH_MALLOC_ENV)
    env.pop("SPPO_FX_RECALIBRATE", None)
    print(f"running {config} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None if args.verbose else subprocess.PIPE,
                         text=True, env=env, timeout=args.worker_timeout)
    if res.returncode:
        tail = (res.stderr or "")[-2000:]
        raise SystemExit(f"{config} failed (exit {res.returncode}):\n{tail}")
    r = json.loads(res.stdout.strip().splitlines()[-1])
    r["process_s"] = time.perf_counter() - t0
    print(f"  {config}: first step {r['first_s']:.1f} s (process {r['process_s']:.0f} s)", file=sys.stderr, flush=True)
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama", choices=["llama", "gpt"])
    p.add_argument("--size", default="small", choices=["tiny", "small", "bench"])
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--fraction", type=float, default=0.3, help="budget as a fraction of eager's peak extra memory")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ", ".join(CONFIGS))
    p.add_argument("--worker-timeout", type=float, default=1800)
    p.add_argument("--verbose", action="store_true", help="show each worker's progress lines")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; choose from {CONFIGS}")
    from sppo_fx.benchmark.report import commit
    from sppo_fx.solver.profile_cache import load_average
    # taken before the first worker runs: edits made while it runs do not change the record
    provenance = {"commit": commit(), "load_average_1min": load_average()}
    results = {}
    with tempfile.TemporaryDirectory(prefix="sppo_first_step_") as tmp:
        caches = {"torch.compile": os.path.join(tmp, "tc"), "sppo budget": os.path.join(tmp, "sppo")}
        eager = _run(args, "eager", os.path.join(tmp, "eager"), None)
        results["eager"] = eager
        budget = max(int(eager["peak_extra"] * args.fraction), 1)
        for config in configs:
            if config == "eager":
                continue
            kind = config.rstrip(" 2")
            results[config] = _run(args, config, caches[kind], budget if kind == "sppo budget" else None)
    _report(args, results, budget)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **provenance, "load_average_1min_end": load_average(),
                       "budget": budget, "results": results}, f, indent=2)


def _report(args, results: dict, budget: int) -> None:
    from tabulate import tabulate
    ref = results.get("torch.compile")
    rows = []
    for name, r in results.items():
        vs = f"{r['first_s'] / ref['first_s']:.2f}x" if ref else ""
        rows.append((name, f"{r['import_s']:.1f}", f"{r['first_s']:.1f}", vs))
    print(f"{args.model} '{args.size}', {args.seq_len} tokens, budget {budget / 2**20:.1f} MiB "
          f"({args.fraction:.0%} of eager's peak extra {results['eager']['peak_extra'] / 2**20:.0f} MiB), "
          f"{os.cpu_count()} CPUs")
    print(tabulate(rows, headers=["config", "import s", "first step s", "vs torch.compile"]))
    for name, r in results.items():
        if name.startswith("sppo") and r["phases"]:
            print(f"\n{name}: first step {r['first_s']:.1f} s by phase ({r.get('plan', '')})")
            print(tabulate([(n, f"{s:.1f}") for n, s in r["phases"]], headers=["phase", "seconds"]))


if __name__ == "__main__":
    main()
