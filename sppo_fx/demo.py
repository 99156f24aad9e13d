"""The demo: train the Llama-style model on long byte-level sequences through sppo_fx.

The corpus is the Python standard library's own source files (present on every machine
with Python). Each step draws `batch` windows of `seq_len + 1` bytes; tokens are bytes.
The first step's gradients are checked against the eager, unchunked model. Without
`--chunks`, eager's peak extra memory is measured first and the model trains under a budget
that is a fraction of it; the solver's plan, the first call's phases, measured peak against
the budget and step time against eager are printed.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sysconfig
import time

import torch
from tabulate import tabulate

import sppo_fx
from sppo_fx.util.log import enable, record_phases, summarize
from sppo_fx.util.rss import rss_bytes, start_peak
from sppo_fx.models import build


def stdlib_corpus(max_bytes: int = 8 << 20) -> torch.Tensor:
    """Bytes of the standard library's .py files (sorted, concatenated) as a uint8 tensor."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total == 0:
        raise RuntimeError(f"no Python source files under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def sample_batch(corpus: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator):
    """(tokens, next-byte targets), each [batch, seq_len] int64."""
    starts = torch.randint(0, corpus.numel() - seq_len - 1, (batch,), generator=gen)
    windows = torch.stack([corpus[s:s + seq_len + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]


def measured_step(step) -> tuple[float, int]:
    """(seconds, peak extra bytes) of `step()`: the process's peak RSS during the step (VmHWM,
    reset first) minus its RSS before it, as bench/memory.py measures on a CPU. Accurate
    when glibc returns freed blocks to the OS (scripts/demo.sh sets MALLOC_MMAP_THRESHOLD_)."""
    base = start_peak()
    t0 = time.perf_counter()
    step()
    seconds = time.perf_counter() - t0
    return seconds, max(rss_bytes("VmHWM") - base, 0)


# eager's measured steps: its step time is their median, as the library's is the median of
# its steps after the first, so one unlucky (or lucky) step does not set the ratio
EAGER_STEPS = 3


def run(steps: int, seq_len: int, chunks: int | None = None, batch: int = 1, size: str = "small",
        lr: float = 1e-3, seed: int = 0, compile: bool = True,  # noqa: A002
        budget_fraction: float = 0.3) -> dict:
    """Train and report; returns the figures it printed (for tests).

    With `chunks` the model trains with that many chunks and no budget; otherwise eager's
    peak extra memory is measured first and the budget is `budget_fraction` of it.
    """
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    corpus = stdlib_corpus()
    model = build("llama", size, vocab_size=256)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"sppo_fx demo: Llama-style '{size}' model, {n_params / 1e6:.1f}M parameters; "
          f"{corpus.numel() / 1e6:.1f} MB of standard-library source; batch {batch} x {seq_len} bytes; "
          f"chunk programs {'compiled by Inductor' if compile else 'run op by op (no Inductor)'}", flush=True)
    report: dict = {"losses": [], "peaks": [], "step_s": [], "eager_between_s": []}
    budget = None
    if chunks is None:
        x, y = sample_batch(corpus, batch, seq_len, gen)
        eager_step = lambda: model(x, y).backward()  # noqa: E731
        eager_step()  # warm-up: the allocator's and autograd's first-use costs
        model.zero_grad(set_to_none=True)
        eager_runs = []
        for _ in range(EAGER_STEPS):  # a median, as the library's steps are reported
            eager_runs.append(measured_step(eager_step))
            model.zero_grad(set_to_none=True)
        eager_s = statistics.median(s for s, _ in eager_runs)
        eager_peak = int(statistics.median(p for _, p in eager_runs))
        budget = max(int(eager_peak * budget_fraction), 1)
        report.update(eager_peak=eager_peak, eager_s=eager_s, budget=budget)
        print(f"\neager, whole sequence: peak extra memory {eager_peak / 2**20:.0f} MiB, step {eager_s:.2f} s "
              f"(medians of {EAGER_STEPS} steps)")
        print(f"budget: {budget_fraction:.0%} of it = {budget / 2**20:.0f} MiB\n", flush=True)
        compiled = sppo_fx.compile(model, budget=budget, compile=compile)
    else:
        compiled = sppo_fx.compile(model, chunks=chunks, compile=compile)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(steps):
        x, y = sample_batch(corpus, batch, seq_len, gen)
        model.zero_grad(set_to_none=True)
        holder = {}

        def train_step():
            loss = compiled(x, y)
            loss.backward()
            holder["loss"] = loss

        if step == 0:
            with record_phases() as phases:
                elapsed, peak = measured_step(train_step)
            report["first_step_phases"] = summarize(phases, elapsed)
            print(f"\nfirst call: {elapsed:.1f} s, of which")
            print(tabulate([(name, f"{sec:.1f}") for name, sec in report["first_step_phases"]],
                           headers=["phase", "seconds"]))
            print("\nThe solver's plan:" if budget is not None else "\nChunk plan:")
            print(compiled.plan.table())
            report["grad_check"] = _check_grads(model, x, y, holder["loss"].detach())
        else:
            compiles_before, kept_before = _chunk_zero_compiles(compiled)
            elapsed, peak = measured_step(train_step)
            report["peaks"].append(peak)
            report["step_s"].append(elapsed)
            compiles_after, kept_after = _chunk_zero_compiles(compiled)
            if compiles_after > compiles_before:
                report["chunk_zero_compiled_at"] = step
                report["compile_kept_bytes"] = kept_after - kept_before
        opt.step()
        loss = holder["loss"].item()
        report["losses"].append(loss)
        if step and budget is not None and _no_compile_under_way(compiled):
            # eager's step again, between the library's: a process runs fast or slow for
            # seconds at a time on a shared machine, so the ratio compares neighbours
            model.zero_grad(set_to_none=True)
            report["eager_between_s"].append(measured_step(eager_step)[0])
            model.zero_grad(set_to_none=True)
        if step == 0:
            print(f"\n{'step':>4}  {'loss':>8}  {'s/step':>7}  {'peak extra MiB':>14}")
            print(f"{step:4d}  {loss:8.4f}  {elapsed:7.2f}  {'(first call)':>14}", flush=True)
        else:
            note = ("  chunk 0's Inductor compile (codegen/background.py)"
                    if report.get("chunk_zero_compiled_at") == step else "")
            print(f"{step:4d}  {loss:8.4f}  {elapsed:7.2f}  {peak / 2**20:14.0f}{note}", flush=True)
    if budget is not None and report["peaks"]:
        _summary(report, compiled.plan)
    return report


def _no_compile_under_way(compiled) -> bool:
    """No chunk-0 compile runs beside the steps now (`codegen/background.py`): an eager
    step timed beside one would share its cores."""
    codegen = getattr(compiled, "codegen", None)
    return codegen is None or not codegen.compile_under_way()


def _chunk_zero_compiles(compiled) -> tuple[int, int]:
    """(chunk 0's exact-size programs Inductor has compiled so far, the RSS those compiles
    kept in this process: `CodegenStats.background_compile_rss_bytes`); (0, 0) without
    Inductor. The first call runs chunk 0 op by op, and a later step pays its compile."""
    codegen = getattr(compiled, "codegen", None)
    if codegen is None:
        return 0, 0
    return codegen.stats.background_compiles, codegen.stats.background_compile_rss_bytes


def _summary(report: dict, plan) -> None:
    budget, eager_peak = report["budget"], report["eager_peak"]
    at = report.get("chunk_zero_compiled_at")
    kept = report.get("compile_kept_bytes", 0) if at is not None else 0
    # the step that took chunk 0's compiled program measures its code and the compiler's
    # state on top of its tensors; the budget is the tensors'. Valid because the compile
    # runs at chunk 0's forward, the step's first call, before its tensors peak
    peaks = [max(p - kept, 0) if k == at else p for k, p in enumerate(report["peaks"], start=1)]
    peak = max(peaks)
    steady = [s for k, s in enumerate(report["step_s"], start=1) if k != at]
    # the step that paid chunk 0's compile is not a training step's time
    step_s = statistics.median(steady or report["step_s"])
    which = f"steps 1-{len(report['step_s'])}" + (f" but step {at}, which compiled chunk 0" if at and steady else "")
    tolerance = 0.10 * budget + 16 * 2**20  # what RSS holds that no plan controls (bench/memory.py)
    fits = "within the budget" if peak <= budget else (
        "within the budget's tolerance (10% + 16 MiB)" if peak <= budget + tolerance else "OVER the budget")
    less = f", step {at} less chunk 0's compiled program" if kept else ""
    print(f"\nmeasured peak extra memory {peak / 2**20:.0f} MiB (largest of steps 1-{len(report['peaks'])}{less}) "
          f"vs budget {budget / 2**20:.0f} MiB: {fits}; predicted {plan.peak_bytes / 2**20:.0f} MiB; "
          f"eager {eager_peak / 2**20:.0f} MiB ({peak / eager_peak:.0%} of eager)")
    others = [p for k, p in enumerate(report["peaks"], start=1) if k != at]
    if at is not None and (others or kept):  # that step's RSS also holds what the compile left behind
        taken = (f"; its RSS grew by {kept / 2**20:.0f} MiB while it took the compiled program "
                 f"(code and compiler state, held after garbage collection)" if kept else "")
        without = (f"; without step {at}: {max(others) / 2**20:.0f} MiB ({max(others) / eager_peak:.0%} of eager)"
                   if others else "")
        print(f"  step {at}, which compiled chunk 0: {report['peaks'][at - 1] / 2**20:.0f} MiB{taken}{without}")
    between = report.get("eager_between_s") or []
    if between:  # eager's steps taken between the library's: neighbours in time
        eager_s = statistics.median(between)
        eager = (f"eager {eager_s:.2f} s (median of {len(between)} eager steps taken between them; "
                 f"{report['eager_s']:.2f} s measured first)")
    else:
        eager_s, eager = report["eager_s"], f"eager {report['eager_s']:.2f} s"
    print(f"step time {step_s:.2f} s (median of {which}) vs {eager} ({step_s / eager_s:.2f}x)")
    losses = report["losses"]
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")


def _check_grads(model, x, y, loss):
    chunked = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    ref = model(x, y)
    ref.backward()
    rows, worst = [], 0.0
    ok = torch.allclose(loss, ref.detach(), rtol=1e-4, atol=1e-5)
    for name, p in model.named_parameters():
        diff = (chunked[name] - p.grad).abs().max().item()
        scale = p.grad.abs().max().item()
        match = torch.allclose(chunked[name], p.grad, rtol=1e-4, atol=1e-5)
        ok &= match
        worst = max(worst, diff)
        rows.append((name, f"{diff:.2e}", f"{scale:.2e}", "ok" if match else "MISMATCH"))
    for name, p in model.named_parameters():  # leave the chunked gradients for the optimizer
        p.grad = chunked[name]
    print(f"\nFirst step vs eager (full sequence): loss {loss.item():.6f} vs {ref.item():.6f}")
    shown = rows[:4] + ([("...", "", "", "")] if len(rows) > 6 else []) + rows[-2:]
    print(tabulate(shown, headers=["parameter", "max |diff|", "max |grad|", "rtol 1e-4, atol 1e-5"]))
    print(f"gradients of all {len(rows)} parameters match eager: {'yes' if ok else 'NO'} "
          f"(largest difference {worst:.2e})")
    if not ok:
        raise SystemExit("gradient check against eager failed")
    return {"ok": ok, "max_abs_diff": worst}


def add_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps")
    parser.add_argument("--seq-len", type=int, default=2048, help="bytes per sequence")
    parser.add_argument("--budget", type=float, default=0.3, dest="budget_fraction",
                        help="memory budget as a fraction of eager's measured peak extra memory")
    parser.add_argument("--chunks", type=int, default=None,
                        help="train with this many chunks and no budget instead")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--size", default="small", choices=["tiny", "small", "bench"], help="model preset")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help="run the chunk programs op by op instead of compiling them with Inductor")


def main(args: argparse.Namespace) -> int:
    enable()  # progress lines on stderr (SPPO_FX_LOG=debug adds every pass's graphs)
    run(args.steps, args.seq_len, args.chunks, args.batch, args.size, args.lr, args.seed, args.compile,
        args.budget_fraction)
    return 0
