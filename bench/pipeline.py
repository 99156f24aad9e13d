"""Pipeline benchmark: measured vs predicted step time and bubble fraction (P = 1 or more).

    python bench/pipeline.py [--stages 2] [--size small] [--seq-len 2048] [--chunks auto]
    python bench/pipeline.py --stages 1 --size bench --seq-len 1024 --chunks 8

1. Calibration, out of sample (this process, one thread per rank as under torchrun): the
   eager model's forward and forward+backward on the full sequence give the FLOP rate and
   the backward/forward ratio; a *two-chunk* run through sppo_fx gives the per-chunk
   efficiency (c_half) (`sppo_fx/benchmark/calibration.py`, shared with bench/scale.py).
   The measured configuration itself is never used to calibrate.
2. The run: P ranks on this machine (gloo; P = 1 runs in this process), a warm-up step and
   timed steps; every pipeline rank records each action's wall-clock span.
3. Predictions of the same schedule with durations from the cost model: the schedule
   validator's clock (`solver.pipeline_chunks.predict`) and the event simulator
   (`schedule.simulator.simulate`, compute stream per rank, links, copy engines).

Measured bubble = 1 - (compute time summed over ranks) / (P * step time). On a 2-core
machine with P = 2 each rank has one core; figures from such a small machine say whether
the model of the schedule holds, not how a GPU cluster behaves.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from tabulate import tabulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import sppo_fx  # noqa: E402
from sppo_fx.benchmark.calibration import bench_model_and_data, calibrate_compute  # noqa: E402
from sppo_fx.capture import capture  # noqa: E402
from sppo_fx.passes import transform  # noqa: E402
from sppo_fx.runtime.launch import start_local_ranks  # noqa: E402
from sppo_fx.schedule import Action, ActionKind  # noqa: E402
from sppo_fx.solver.partition import cost_model_from_graph  # noqa: E402
from sppo_fx.schedule import build_schedule  # noqa: E402
from sppo_fx.solver.pipeline_chunks import chunk_seconds, predict  # noqa: E402
from sppo_fx.schedule.simulator import simulate  # noqa: E402


def _model_and_data(args):
    return bench_model_and_data(args.model, args.size, args.batch, args.seq_len)


def worker(args):
    from sppo_fx.runtime.distributed import init_from_env, rank_device
    rank, world = init_from_env(120)
    model, (x, y) = _model_and_data(args)
    device = rank_device()  # cuda:LOCAL_RANK under NCCL
    model, x, y = model.to(device), x.to(device), y.to(device)
    chunks = None if args.chunks == "auto" else int(args.chunks)
    compiled = sppo_fx.compile(model, chunks=chunks, stages=world, microbatches=args.microbatches,
                               schedule=args.schedule, compile=False, timeout_s=300)
    steps = []
    for step in range(args.steps + 1):
        model.zero_grad(set_to_none=True)
        torch.distributed.barrier()
        t = time.perf_counter()
        compiled.step(x, y)
        steps.append(time.perf_counter() - t)
    ex = compiled.pipeline.executor
    busy = sum(e - s for a, s, e in ex.timeline
               if not a.startswith("wait:") and Action.parse(a).kind in (ActionKind.F, ActionKind.B))
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"steps": steps[1:], "busy_last": busy, "timeline": ex.timeline,
                   "chunk_lengths": compiled.plan.chunk_lengths}, f)
    torch.distributed.destroy_process_group()


def _launch(args, out):
    cmd = [sys.executable, __file__, "--worker", "--out", out] + sys.argv[1:]
    procs = start_local_ranks(cmd, args.stages, capture=False)
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"pipeline ranks failed with exit codes {codes}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama", choices=["llama", "gpt"])
    p.add_argument("--size", default="small")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--chunks", default="auto")
    p.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    if args.worker:
        return worker(args)

    torch.set_num_threads(1)  # each rank gets one thread under torchrun / this launcher
    model, (x, y) = _model_and_data(args)
    mb = args.batch // args.microbatches
    cap = capture(model, None, None, (x[:mb], y[:mb]), {}, None, 1)
    graph, _ = transform(cap)
    cost = cost_model_from_graph(graph, cap.seq)
    T = args.seq_len

    # ---- calibration (never the measured configuration) ----
    calib = calibrate_compute(model, (x[:mb], y[:mb]), cost, T)
    compute = calib.compute

    # ---- the measured run ----
    if args.stages == 1:
        chunks = None if args.chunks == "auto" else int(args.chunks)
        run = sppo_fx.compile(model, chunks=chunks, microbatches=args.microbatches, compile=False)
        times = []
        for _ in range(args.steps + 1):
            model.zero_grad(set_to_none=True)
            t = time.perf_counter()
            run.step(x, y)
            times.append(time.perf_counter() - t)
        step, lengths = statistics.median(times[1:]), run.plan.chunk_lengths
        busy, bubble = step, 0.0
    else:
        with tempfile.TemporaryDirectory() as out:
            args.out = out
            _launch(args, out)
            ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(args.stages)]
        lengths = ranks[0]["chunk_lengths"]
        step = statistics.median([statistics.median(r["steps"]) for r in ranks])
        busy = sum(r["busy_last"] for r in ranks)
        bubble = 1 - busy / (args.stages * step)

    # ---- predictions ----
    pred = predict(cost, compute, lengths, args.stages, args.microbatches, args.schedule)
    times = chunk_seconds(cost, compute, lengths, args.stages)
    sched = build_schedule(args.schedule, args.stages, args.microbatches, len(lengths))
    sim = simulate(sched, lambda a: times[a.chunk][0] if a.kind is ActionKind.F else
                   times[a.chunk][1] if a.kind is ActionKind.B else 0.0, link_bytes_per_s=None)
    rows = [
        ("step time (s)", f"{step:.3f}", f"{pred.step_seconds:.3f}", f"{sim.step_seconds:.3f}",
         f"{sim.step_seconds / step:.2f}"),
        ("bubble fraction", f"{bubble:.1%}", f"{pred.bubble_fraction:.1%}", f"{sim.bubble_fraction:.1%}", ""),
        ("compute, all ranks (s)", f"{busy:.3f}", f"{pred.busy_seconds:.3f}", f"{sum(sim.busy_seconds.values()):.3f}",
         f"{sum(sim.busy_seconds.values()) / busy:.2f}"),
    ]
    print(f"\nsppo_fx pipeline benchmark: {args.model}-{args.size}, T={T}, batch {args.batch}, "
          f"P={args.stages}, M={args.microbatches}, {args.schedule}, chunks {lengths}")
    print(f"calibration (1 thread, out of sample): {calib.describe()}")
    print(tabulate(rows, headers=["", "measured", "predicted (schedule clock)", "predicted (simulator)",
                                  "simulator / measured"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"measured_step_s": step, "predicted_step_s": pred.step_seconds,
                       "simulated_step_s": sim.step_seconds, "measured_bubble": bubble,
                       "predicted_bubble": pred.bubble_fraction, "simulated_bubble": sim.bubble_fraction,
                       "chunk_lengths": lengths, "t_eager": calib.t_eager, "t_two_chunks": calib.t_two_chunks}, f, indent=1)


if __name__ == "__main__":
    main()
