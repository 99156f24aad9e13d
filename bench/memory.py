"""Memory benchmark: sppo_fx under memory budgets vs eager, checkpointing and torch.compile.

    python bench/memory.py [--model llama --size bench --seq-len 4096 --steps 2 --rounds 1]
    python bench/memory.py --device cuda --dtype bf16 --seq-len 16384     # on a GPU

The default sequence is 4096 tokens: at 2048 the bench model's parameter gradients
(101M fp32 parameters, 385 MiB, which every configuration holds at the end of backward)
are already 20% of eager's peak extra memory, so a 25% budget leaves nothing for
activations; at 4096 activations dominate, as they do for the long sequences SPPO is for.

Configurations, each in its own process (fresh allocator, fresh caches):
    eager          the model as written, full sequence
    checkpoint     torch.utils.checkpoint around every block (use_reentrant=False)
    compile-amb    torch.compile with torch._functorch.config.activation_memory_budget = 0.5
    sppo           sppo_fx, FLOPs-balanced chunks, no budget (compile=False unless --sppo-compile)
    sppo-50%       sppo_fx with budget = 50% of eager's measured peak extra memory (disk tier)
    sppo-25%       sppo_fx with budget = 25%
    sppo-skel-25%  (optional) budget 25% with the K/V skeleton offloaded (skeleton="offload")

With --rounds N the whole list runs N times, interleaved (eager, ..., eager, ...): each
configuration's step time is the median over rounds, its ratio to eager the median of the
per-round ratios to that round's eager (which cancels the machine's drift between
processes), its peak memory and gradient difference the worst of the rounds.

Measured per configuration: median step time after one warm-up step (which includes
tracing, compiling, calibrating), peak extra memory = the process's peak RSS (VmHWM, reset
after the warm-up) minus its RSS just before the timed steps with gradients freed — so
activations, temporaries and parameter gradients all count; predicted peak (sppo_fx's plan);
the largest gradient difference from eager.

On CUDA (--device cuda) the same configurations run on the GPU: peak extra memory =
torch.cuda.max_memory_allocated() (peak stats reset after the warm-up) minus
torch.cuda.memory_allocated() at the same point as the CPU baseline (gradients freed, just
before the timed step), so it counts live tensors, not the caching allocator's reserve;
the budget configurations offload to the host tier (pinned memory, CUDA streams) instead
of disk; step times are taken between torch.cuda.synchronize() calls. --dtype bf16 runs
the model in bfloat16 (parameters, activations and gradients).

Each worker runs with MALLOC_MMAP_THRESHOLD_=131072 so that glibc returns large freed
blocks to the OS and RSS follows the live tensors.

Tolerance for "measured ≤ budget": the budget covers what the plan predicts; RSS also holds
what no plan controls — malloc's retained free chunks below the mmap threshold, the disk
tier's thread stacks and I/O buffers, Python objects of the autograd graph. The benchmark
states the tolerance it checks: 10% of the budget + 16 MiB.
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

import torch
from tabulate import tabulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONFIGS = ["eager", "checkpoint", "compile-amb", "sppo", "sppo-50%", "sppo-25%"]


def _rss(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _cuda_peak(step, device):
    """(seconds, peak extra bytes) of one step on a CUDA device: max_memory_allocated after
    resetting the peak stats, minus what is allocated before the step."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    t = time.perf_counter()
    step()
    torch.cuda.synchronize(device)
    return time.perf_counter() - t, torch.cuda.max_memory_allocated(device) - base


def worker(args):
    import sppo_fx
    from sppo_fx.models import build
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = build(args.model, args.size)
    if cuda or dtype != torch.float32:
        model = model.to(device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    v = model.config.vocab_size
    x = torch.randint(0, v, (1, args.seq_len), generator=gen)
    y = torch.randint(0, v, (1, args.seq_len), generator=gen)
    if cuda:
        x, y = x.to(device), y.to(device)
    name, predicted, plan = args.config, None, None
    if name == "eager":
        step = lambda: model(x, y).backward()  # noqa: E731
    elif name == "checkpoint":
        from torch.utils.checkpoint import checkpoint
        for block in getattr(model, "layers", None) or model.h:
            block.forward = (lambda f: lambda *a: checkpoint(f, *a, use_reentrant=False))(block.forward)
        step = lambda: model(x, y).backward()  # noqa: E731
    elif name == "compile-amb":
        import torch._functorch.config as functorch_config
        functorch_config.activation_memory_budget = 0.5
        compiled = torch.compile(model)
        step = lambda: compiled(x, y).backward()  # noqa: E731
    else:
        # sppo | sppo-N% | sppo-skel-N% (the K/V skeleton offloaded whatever the solver says)
        budget = None if name == "sppo" else int(args.eager_peak * int(name.split("-")[-1].rstrip("%")) / 100)
        tier = args.tier or ("host" if cuda else None)  # None: sppo_fx's default for budgets (disk)
        compiled = sppo_fx.compile(model, budget=budget, chunks=None if budget else args.chunks,
                                   compile=args.sppo_compile, offload_dir=args.offload_dir,
                                   offload=tier if budget else None,
                                   skeleton="offload" if "-skel-" in name else "auto")
        step = lambda: compiled(x, y).backward()  # noqa: E731
    model.zero_grad(set_to_none=True)
    t = time.perf_counter()
    step()
    if cuda:
        torch.cuda.synchronize(device)
    warmup = time.perf_counter() - t
    if name.startswith("sppo"):
        plan = compiled.plan
        predicted = plan.peak_bytes
    times, peaks = [], []
    for _ in range(args.steps):
        model.zero_grad(set_to_none=True)
        if cuda:
            dt, peak = _cuda_peak(step, device)
            times.append(dt)
            peaks.append(peak)
            continue
        base = _rss("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
        peaks.append(_rss("VmHWM") - base)
    grads = {n: p.grad for n, p in model.named_parameters()}
    if cuda:
        grads = {n: g.detach().float().cpu() for n, g in grads.items()}
    torch.save(grads, args.grads_out)
    print(json.dumps({"config": name, "step_s": statistics.median(times), "warmup_s": warmup,
                      "peak_extra": max(peaks), "predicted": predicted, "budget": plan.budget_bytes if plan else None,
                      "plan": str(plan) if plan else None,
                      "recompute": getattr(plan, "recompute", None) if plan else None,
                      "skeleton": getattr(plan, "skeleton", None) if plan else None,
                      **({"device": torch.cuda.get_device_name(device)} if cuda else {})}))


def main():
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
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)
    p.add_argument("--eager-peak", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--grads-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--offload-dir", default=None, help="directory of the disk tier (default: system temp)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the model runs (cuda: GPU memory stats, host-tier offload)")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="model dtype")
    p.add_argument("--tier", default=None, choices=["disk", "host", "device"],
                   help="offload tier of the budget configurations (default: disk on CPU, host on CUDA)")
    p.add_argument("--worker-timeout", type=float, default=None,
                   help="seconds each configuration may take (default: no limit); on expiry it is reported as failed")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    runs, eager_peak, ref = [], 0, None
    configs = args.configs.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name in configs:
                if args.json and runs:  # what finished so far survives a kill of this run
                    with open(args.json, "w") as f:
                        json.dump(runs, f, indent=1)
                r = _run_worker(args, name, eager_peak, tmp)
                r["round"] = round_
                if "error" not in r:
                    if name == "eager" and ref is None:
                        eager_peak = r["peak_extra"]  # budgets stay those of the first round
                        ref = torch.load(os.path.join(tmp, "eager.pt"))
                    grads = torch.load(os.path.join(tmp, f"{name}.pt"))
                    r["max_grad_diff"] = (max((grads[k] - ref[k]).abs().max().item() for k in ref)
                                          if ref is not None else float("nan"))
                runs.append(r)
    results = _combine_rounds(runs, configs)
    base = next((r for r in results if r["config"] == "eager" and "error" not in r), None)
    rows = []
    for r in results:
        if "error" in r:
            rows.append((r["config"], "failed: " + r["error"][:70], "", "", "", "", "", "", "", ""))
            continue
        budget_ok = ""
        if r.get("budget"):
            limit = r["budget"] * 1.10 + 16 * 2**20
            budget_ok = "yes" if r["peak_extra"] <= limit else "NO"
        step_ratio = (f"{r['step_ratio']:.3f}" if r.get("step_ratio") is not None
                      else _ratio(r["step_s"], base and base["step_s"]))
        rows.append((r["config"], f"{r['step_s']:.2f}", step_ratio,
                     f"{r['peak_extra'] / 2**20:.0f}", _ratio(r["peak_extra"], base and base["peak_extra"]),
                     "-" if r.get("predicted") is None else f"{r['predicted'] / 2**20:.0f}",
                     "-" if r.get("budget") is None else f"{r['budget'] / 2**20:.0f} ({budget_ok})",
                     r.get("recompute") or "-", r.get("skeleton") or "-", f"{r['max_grad_diff']:.1e}"))
    if args.device == "cuda":
        where = next((r["device"] for r in results if r.get("device")), "CUDA")
        memory = "peak extra = max_memory_allocated - allocated before the step"
    else:
        where, memory = f"CPU ({os.cpu_count()} cores)", None
    print(f"\nsppo_fx memory benchmark: {args.model}-{args.size}, T={args.seq_len}, batch 1, {args.dtype}, {where}"
          f"; budgets are fractions of eager's measured peak extra memory" + (f"; {memory}" if memory else ""))
    print(tabulate(rows, headers=["config", "step s", "vs eager", "peak extra MiB", "vs eager", "predicted MiB",
                                  "budget MiB (within 10%+16MiB)", "recompute", "K/V skeleton",
                                  "max |grad - eager|"]))
    for r in results:
        if r.get("plan"):
            print(f"\n{r['config']} plan:\n{r['plan']}")
    if args.rounds > 1:
        print(f"\n{args.rounds} rounds, configurations interleaved; step s = median over rounds, "
              "vs eager = median of each round's ratio to that round's eager, peak = largest of the rounds")
        for r in results:
            if r.get("round_ratios"):
                print(f"  {r['config']}: " + ", ".join(f"{x:.3f}" for x in r["round_ratios"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"configs": results, "runs": runs} if args.rounds > 1 else results, f, indent=1)


def _run_worker(args, name, eager_peak, tmp):
    """One configuration in its own process; its JSON result, or {"config", "error"}."""
    cmd = [sys.executable, __file__, "--worker", "--config", name, "--eager-peak", str(eager_peak),
           "--grads-out", os.path.join(tmp, f"{name}.pt"), "--model", args.model, "--size", args.size,
           "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--chunks", str(args.chunks)]
    if args.sppo_compile:
        cmd.append("--sppo-compile")
    if args.offload_dir:
        cmd += ["--offload-dir", args.offload_dir]
    if args.device != "cpu" or args.dtype != "fp32":
        cmd += ["--device", args.device, "--dtype", args.dtype]
    if args.tier:
        cmd += ["--tier", args.tier]
    print(f"running {name} ...", file=sys.stderr, flush=True)
    # A fixed mmap threshold makes glibc return every large freed block to the OS,
    # so RSS follows live tensors (its dynamic threshold would keep freed gradients
    # resident and hide them from the next step's peak).
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.worker_timeout)
    except subprocess.TimeoutExpired as e:
        if args.device == "cuda":
            _echo_tail(name, e.stderr)
        return {"config": name, "error": f"timed out after {args.worker_timeout:g} s"}
    if res.returncode:
        if args.device == "cuda":
            _echo_tail(name, res.stderr)
        return {"config": name, "error": _error_line(res.stderr) or f"exit code {res.returncode}"}
    r = json.loads(res.stdout.strip().splitlines()[-1])
    print(f"  {name}: step {r['step_s']:.3f} s, peak extra {r['peak_extra'] / 2**20:.0f} MiB "
          f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return r


def _combine_rounds(runs, configs):
    """One result per configuration from interleaved rounds.

    Step time is the median over rounds; the ratio to eager is the median of the per-round
    ratios, each against the eager run of the same round, so slow drifts of the machine
    (other load, page cache, thermal) cancel; peak memory and gradient difference are the
    worst of the rounds. A configuration that failed in any round is reported failed."""
    eager_by_round = {r["round"]: r["step_s"] for r in runs if r["config"] == "eager" and "error" not in r}
    results = []
    for name in configs:
        mine = [r for r in runs if r["config"] == name]
        failed = next((r for r in mine if "error" in r), None)
        if failed or not mine:
            results.append(failed or {"config": name, "error": "not run"})
            continue
        r = dict(mine[0])
        r["step_s"] = statistics.median(x["step_s"] for x in mine)
        r["peak_extra"] = max(x["peak_extra"] for x in mine)
        diffs = [x["max_grad_diff"] for x in mine]
        r["max_grad_diff"] = float("nan") if any(d != d for d in diffs) else max(diffs)  # NaN: no reference
        ratios = [x["step_s"] / eager_by_round[x["round"]] for x in mine if x["round"] in eager_by_round]
        if len(mine) > 1 and ratios:
            r["round_ratios"] = ratios
            r["step_ratio"] = statistics.median(ratios)
        results.append(r)
    return results


def _error_line(stderr: str) -> str:
    """The exception line of a worker's traceback (not a trailing hint)."""
    lines = [ln.strip() for ln in (stderr or "").strip().splitlines()]
    for ln in reversed(lines):
        head = ln.split(":", 1)[0]
        if ":" in ln and " " not in head and (head.endswith(("Error", "Exception", "Budget")) or "." in head):
            return ln
    return lines[-1] if lines else ""


def _ratio(a, b):
    return f"{a / b:.2f}" if b else "-"


def _echo_tail(name, stderr, lines=25):
    """Show the end of a failed worker's stderr (the traceback)."""
    if isinstance(stderr, bytes):
        stderr = stderr.decode(errors="replace")
    tail = (stderr or "").strip().splitlines()[-lines:]
    print(f"  {name} failed; last lines of its stderr:", file=sys.stderr)
    for line in tail:
        print(f"    {line}", file=sys.stderr)
    sys.stderr.flush()


if __name__ == "__main__":
    main()
