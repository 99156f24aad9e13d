"""Memory benchmark: sppo_fx under memory budgets vs eager, checkpointing and torch.compile.

    python bench/memory.py [--model llama --size bench --seq-len 4096 --steps 2 --rounds 1]
    python bench/memory.py --device cuda --dtype bf16 --seq-len 16384     # on a GPU

A front end of the benchmark engine (`sppo_fx/benchmark/`; the same grid is
`sppo-fx bench --anchors eager,checkpoint,compile-amb:0.5 --chunks 8 --budget none,50%,25%`):
this script names its configurations, the engine runs each in its own process, measures,
interleaves rounds and prints the table.

The default sequence is 4096 tokens: at 2048 the bench model's parameter gradients
(101M fp32 parameters, 385 MiB, which every configuration holds at the end of backward)
are already 20% of eager's peak extra memory, so a 25% budget leaves nothing for
activations; at 4096 activations dominate, as they do for the long sequences SPPO is for.

Configurations (--configs):
    eager          the model as written, full sequence
    checkpoint     torch.utils.checkpoint around every block (use_reentrant=False)
    compile        torch.compile(model) (the second baseline: "vs torch.compile" lines)
    compile-amb    torch.compile with torch._functorch.config.activation_memory_budget = 0.5
    sppo           sppo_fx, FLOPs-balanced chunks (--chunks), no budget
    sppo-N%        sppo_fx with budget = N% of eager's measured peak extra memory (disk tier
                   on a CPU, host tier on CUDA, or --tier)
    sppo-skel-N%   budget N% with the K/V skeleton offloaded (skeleton="offload")

Measurements, rounds and ratios are the engine's (`sppo_fx/benchmark/engine.py`,
`sppo_fx/benchmark/worker.py`): median step time after the first call, peak extra memory
(RSS high-water over the pre-step RSS on a CPU, with MALLOC_MMAP_THRESHOLD_=131072 so RSS
follows live tensors; max_memory_allocated over memory_allocated on CUDA), the plan's
predicted peak and step time, the largest gradient difference from eager. With --rounds N
the list runs N times interleaved and "vs eager" is the median of per-round ratios.

Tolerance for "measured ≤ budget": the budget covers what the plan predicts; RSS also holds
what no plan controls — malloc's retained free chunks below the mmap threshold, the disk
tier's thread stacks and I/O buffers, Python objects of the autograd graph. The benchmark
states the tolerance it checks: 10% of the budget + 16 MiB.

Hidden copy: each row that offloads runs one more step under torch.profiler after its timed
steps (so the timings are not perturbed); the lines under the table give the store's copy
time in that step and the fraction of it that overlapped compute
(`sppo_fx/benchmark/copy_overlap.py`, docs/gpu.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sppo_fx.benchmark import BenchConfig, add_ratios, run_grid  # noqa: E402
from sppo_fx.benchmark.copy_overlap import COPY_OVERLAP_ENV  # noqa: E402
from sppo_fx.benchmark.report import commit, format_table, machine  # noqa: E402
from sppo_fx.errors import SppoError  # noqa: E402

CONFIGS = ["eager", "compile", "checkpoint", "compile-amb", "sppo", "sppo-50%", "sppo-25%"]


def config_for(name: str, base: BenchConfig, args) -> BenchConfig:
    """The engine's row for one of this script's configuration names."""
    if name in ("eager", "checkpoint", "compile"):
        return dataclasses.replace(base, kind=name)
    if name == "compile-amb":
        return dataclasses.replace(base, kind="compile-amb", amb=0.5)
    lib = dataclasses.replace(base, kind="sppo", compile=args.sppo_compile)
    if name == "sppo":
        return dataclasses.replace(lib, chunks=args.chunks)
    head, _, pct = name.rpartition("-")
    if head in ("sppo", "sppo-skel") and pct.endswith("%") and pct[:-1].isdigit():
        return dataclasses.replace(lib, budget=pct, offload=args.tier,
                                   skeleton="offload" if head == "sppo-skel" else "auto")
    raise SppoError(f"--configs {name!r}: use eager, checkpoint, compile-amb, sppo, sppo-N% or sppo-skel-N%")


def vs_compile(rows: list[dict]) -> list[str]:
    """Each row's median step time and peak over torch.compile(model)'s, when that row ran."""
    import statistics
    ok = [r for r in rows if "error" not in r]
    base = next((r for r in ok if r["config"]["kind"] == "compile"), None)
    if base is None:
        return []
    t0, m0 = statistics.median(base["step_by_round"]), statistics.median(base["peak_by_round"])
    lines = ["vs torch.compile(model) (median step time, peak extra memory):"]
    for r in ok:
        t, m = statistics.median(r["step_by_round"]), statistics.median(r["peak_by_round"])
        lines.append(f"  {r['label']:<24} time {t / t0:5.2f}x  memory {m / max(m0, 1):5.2f}x")
    return lines


def hidden_copy(runs: list[dict]) -> list[str]:
    """The "hidden copy" lines of the rows that offload: the store's copy time in the extra
    profiled step and the fraction of it that overlapped compute (median over rounds)."""
    import statistics
    by_label: dict[str, list[dict]] = {}
    for r in runs:
        if r.get("copy_overlap") is not None:
            by_label.setdefault(r["label"], []).append(r["copy_overlap"])
    if not by_label:
        return []
    lines = ["hidden copy (one extra step under torch.profiler after the timed ones; "
             "copy time hidden behind compute / all copy time):"]
    width = max(len(label) for label in by_label)
    for label, ovs in by_label.items():
        fracs = [o["hidden_fraction"] for o in ovs if o["hidden_fraction"] is not None]
        copy_ms = statistics.median(o["copy_s"] for o in ovs) * 1e3
        hidden = f"{statistics.median(fracs):6.1%}" if fracs else "   n/a (no copies)"
        moved = [o["bytes"] for o in ovs if o.get("bytes")]
        mib = f", {statistics.median(moved) / 2**20:.0f} MiB moved" if moved else ""
        lines.append(f"  {label:<{width}} hidden {hidden}  of {copy_ms:8.1f} ms copy "
                     f"({ovs[0]['copies']} copies{mib})")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama")
    p.add_argument("--size", default="bench")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--chunks", type=int, default=8, help="chunks of the no-budget sppo configuration")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1,
                   help="run the configuration list this many times, interleaved; report medians and "
                        "per-round ratios to eager (CPU timings drift by 5-10%% between processes)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--sppo-compile", action="store_true", help="compile sppo's chunk programs with Inductor")
    p.add_argument("--json", default=None, help="write the engine's record (grid, machine, raw rounds) here")
    p.add_argument("--offload-dir", default=None, help="directory of the disk tier (default: system temp)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the model runs (cuda: GPU memory stats, host-tier offload)")
    p.add_argument("--dtype", default="fp32", choices=["bf16", "fp32"], help="model dtype")
    p.add_argument("--tier", default=None, choices=["disk", "host", "device"],
                   help="offload tier of the budget configurations (default: disk on CPU, host on CUDA)")
    p.add_argument("--worker-timeout", type=float, default=None,
                   help="seconds each configuration may take (default: no limit); on expiry it is reported as failed")
    args = p.parse_args()
    base = BenchConfig(model=args.model, size=args.size, seq_len=args.seq_len, steps=args.steps,
                       dtype=args.dtype, device=args.device, offload_dir=args.offload_dir)
    os.environ[COPY_OVERLAP_ENV] = "1"  # the workers of offloading rows profile one extra step
    try:
        configs = [config_for(name, base, args) for name in args.configs.split(",")]
        result = run_grid(configs, rounds=args.rounds, timeout=args.worker_timeout,
                          progress=lambda line: print(line, file=sys.stderr, flush=True))
        base_row, notes = add_ratios(result["rows"], "eager")
    except SppoError as e:
        print(f"bench/memory.py: {e}", file=sys.stderr)
        return 2
    result.update(machine=machine(), commit=commit(), baseline="eager", command=" ".join(sys.argv))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    m = result["machine"]
    where = m["gpu"] if args.device == "cuda" else f"CPU ({m['cores']} cores, load {m['load_average_1min']})"
    print(f"\nsppo_fx memory benchmark: {args.model}-{args.size}, T={args.seq_len}, batch 1, {args.dtype}, "
          f"{where}; budgets are fractions of eager's measured peak extra memory")
    print(format_table(result["rows"], base_row, notes))
    for line in vs_compile(result["rows"]) + hidden_copy(result["runs"]):
        print(line)
    for r in result["rows"]:
        if r.get("plan"):
            print(f"  {r['label']}: plan {r['plan']}")
    return 1 if any("error" in r for r in result["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
