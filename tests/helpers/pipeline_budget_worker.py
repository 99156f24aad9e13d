"""One rank of tests/distributed/test_pipeline_budget.py: pipeline steps of a small llama with and
without a per-rank budget (the same chunking), measuring this rank's peak extra memory.

    python tests/helpers/pipeline_budget_worker.py OUT --budget BYTES [model flags]   (writes OUT.rank<r>)

The first step of each captures, solves and builds everything; then, for each measured
step, the parameter gradients are freed, the heap's free pages given back, the process's RSS
high-water mark reset (`sppo_fx.util.rss.start_peak`) and the peak extra memory is VmHWM after
the step minus VmRSS before it (as sppo_fx/benchmark/worker.py measures a CPU row; run it with
MALLOC_MMAP_THRESHOLD_ set, so that freed memory leaves the process). Writes one JSON object
per rank (OUT.rank<r>) and the gradients of each run's last step (OUT.rank<r>.grads.pt).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import sppo_fx
from sppo_fx.models import build
from sppo_fx.runtime.distributed import init_from_env
from sppo_fx.util.rss import rss_bytes, start_peak


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--budget", type=int, required=True, help="bytes per rank; the solver picks the recompute policy")
    p.add_argument("--offload-budgets", default=None,
                   help="comma-separated bytes, one per rank (each rank solves its own plan), under recompute='none'")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--steps", type=int, default=2, help="measured steps after the first")
    p.add_argument("--offload-dir", default=None)
    args = p.parse_args(argv)
    rank, world = init_from_env(120.0)
    torch.manual_seed(0)
    model = build("llama", "tiny", dim=args.dim, ffn_dim=2 * args.dim, n_layers=args.layers)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len), generator=gen)
    y = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len), generator=gen)
    # name -> (budget, recompute): the solver's choice of policy, offload only, and no budget
    # (the same chunking)
    offload_budget = int(args.offload_budgets.split(",")[rank]) if args.offload_budgets else None
    runs = {"auto": (args.budget, "auto"), "offload": (offload_budget, "none"), "unbudgeted": (None, "auto")}
    compiled = {name: sppo_fx.compile(model, chunks=args.chunks, stages=world, microbatches=args.microbatches,
                                      compile=False, budget=budget, recompute=recompute,
                                      offload_dir=args.offload_dir, timeout_s=120)
                for name, (budget, recompute) in runs.items() if name != "offload" or budget is not None}
    started = time.perf_counter()
    losses = {name: [c.step(x, y).item()] for name, c in compiled.items()}  # capture, solve, build
    peaks: dict = {name: [] for name in compiled}
    grads: dict = {}
    for _ in range(args.steps):
        for name, c in compiled.items():
            model.zero_grad(set_to_none=True)
            base = start_peak(strict=True)  # free heap pages given back, VmHWM := the current RSS
            losses[name].append(c.step(x, y).item())
            peaks[name].append(rss_bytes("VmHWM", strict=True) - base)
            grads[name] = {n: prm.grad.clone() for n, prm in model.named_parameters() if prm.grad is not None}
    result = {"rank": rank, "seconds": time.perf_counter() - started}
    for name, c in compiled.items():
        plan, chunk_fn = c.plan, c.pipeline.executor.chunk_fn
        result[name] = {"peak_bytes": max(peaks[name]), "peaks": peaks[name], "losses": losses[name],
                        "budget": runs[name][0], "chunk_lengths": plan.chunk_lengths,
                        "offload_ratios": plan.offload_ratios, "recompute": plan.recompute,
                        "predicted_peak_bytes": plan.peak_bytes,
                        "program_recompute": getattr(chunk_fn, "recompute", None),
                        "store": c.store.stats() if c.store is not None else None}
    torch.save(grads, args.out + f".rank{rank}.grads.pt")
    with open(args.out + f".rank{rank}", "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
