"""Scale-out benchmark: P=2 against S=2 against D=2 on the same model and sequence, measured
against the step time the cost model predicts for each layout.

    python bench/scale.py [--model llama] [--size small] [--seq-len 256] [--batch 2] [--chunks 4]
    python bench/scale.py --layouts 2x1x1,1x1x2 --steps 5 --json scale.json

1. Calibration, out of sample (this process, one thread, as each rank has): the eager
   model gives the FLOP rate and backward/forward ratio, a two-chunk sppo_fx run the
   per-chunk efficiency (`sppo_fx/benchmark/calibration.py`, shared with bench/pipeline.py);
   the first two-rank launch times gloo all-to-all, all-reduce and send/recv at 4 KiB and
   4 MiB (latency and bandwidth of each).
2. The runs, all on the same model, batch, sequence and chunk lengths: one process
   (P=D=S=1, the reference), then each layout P×D×S on two local ranks (gloo), a warm-up
   step and timed steps; a step's time is the slower rank's, after a barrier. Every rank
   counts the bytes it sends through torch.distributed in the last step.
3. Predictions (`sppo_fx/solver/layout.py: predict_layout`): the pipeline schedule clock on
   each rank's share of the FLOPs (P: its stage; S: 1/S of the tokens outside attention
   and 1/S of the heads inside it; D: 1/D of the sequences), plus the all-to-alls (S: 4 per
   attention site per chunk forward, 4 backward), the gradient all-reduce over dp × sp (S
   and D: one per parameter, 2·(n-1)/n of its bytes) and, for P, the stage-boundary
   transfers on the fill and drain and the tied parameters' gradient exchange, at the
   calibrated link rates.

What 2 cores can show: whether the model of each layout holds on this machine, i.e. that
each rank's compute is the predicted share (1/P of the layers, ~1/S or 1/D of the FLOPs
per chunk), that the communication counted at run time is the bytes predicted (all-to-all
volume, gradient all-reduce, boundary activations), and that measured over predicted is
near 1 for every layout alike.
What 2 cores cannot show: speed-up. Two ranks on two cores that other processes share
(the load average is printed with the numbers) compete with everything else on the
machine, so a layout's step time against the one-process step says little about how it
scales; and the link here is loopback through gloo (shared memory copies by the same
cores), not NVLink or InfiniBand, so communication's share of the step is not a cluster's.
Nor can it pin the time of communication: every collective is a rendezvous of the two
ranks, and on an oversubscribed machine each one waits for whichever rank the scheduler
has put aside, so S=2's 8 all-to-alls per attention site per chunk measure many times
their predicted transfer time (the "measured ms" column) while their bytes match exactly.
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

import sppo_fx  # noqa: E402
from sppo_fx.benchmark.calibration import bench_model_and_data, CommCounter, calibrate_compute, measure_links  # noqa: E402
from sppo_fx.capture import capture  # noqa: E402
from sppo_fx.passes import transform  # noqa: E402
from sppo_fx.runtime.launch import start_local_ranks  # noqa: E402
from sppo_fx.solver.layout import LinkModel, attention_sites, predict_layout  # noqa: E402
from sppo_fx.solver.partition import cost_model_from_graph  # noqa: E402

KINDS = ("all-to-all", "all-reduce", "p2p")


def _model_and_data(args):
    return bench_model_and_data(args.model, args.size, args.batch, args.seq_len)


def _layout(text: str) -> tuple[int, int, int]:
    pp, dp, sp = (int(v) for v in text.lower().split("x"))
    return pp, dp, sp


def _steps(compiled, model, x, y, steps, barrier=None, counter=None):
    """Step times (warm-up first) and the counter's bytes of the last step."""
    times = []
    for _ in range(steps + 1):
        model.zero_grad(set_to_none=True)
        if barrier:
            barrier()
        if counter:
            counter.reset()
        t = time.perf_counter()
        compiled.step(x, y)
        times.append(time.perf_counter() - t)
    return times


def worker(args):
    from sppo_fx.runtime.distributed import init_from_env
    rank, world = init_from_env(120)
    links = measure_links() if args.links else None
    pp, dp, sp = _layout(args.layout)
    model, (x, y) = _model_and_data(args)
    compiled = sppo_fx.compile(model, chunks=args.chunks, stages=pp, data_parallel=dp, seq_parallel=sp,
                               compile=False, timeout_s=300)
    with CommCounter() as counter:
        times = _steps(compiled, model, x, y, args.steps, torch.distributed.barrier, counter)
    executor = getattr(getattr(compiled, "pipeline", None), "executor", None)
    waits = sum(e - s for a, s, e in executor.timeline if a.startswith("wait:")) if executor else 0.0
    seconds = dict(counter.seconds, p2p=waits)  # p2p: waiting on receives, the fill/drain bubble included
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"steps": times, "bytes": counter.bytes, "calls": counter.calls, "seconds": seconds,
                   "chunk_lengths": compiled.plan.chunk_lengths,
                   "links": {k: [v.latency_s, v.bytes_per_s] for k, v in links.items()} if links else None}, f)
    torch.distributed.destroy_process_group()


def _launch(args, layout: str, links: bool) -> list[dict]:
    pp, dp, sp = _layout(layout)
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, __file__, "--worker", "--out", out, "--layout", layout] + sys.argv[1:]
        if links:
            cmd.append("--links")
        procs = start_local_ranks(cmd, pp * dp * sp, capture=False)
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"layout {layout}: ranks failed with exit codes {codes}")
        return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(pp * dp * sp)]


def _load() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load average: %.2f, %.2f, %.2f" % os.getloadavg()


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama", choices=["llama", "gpt"])
    p.add_argument("--size", default="small")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=2, help="sequences per step (D=2 takes half each)")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    p.add_argument("--layouts", default="2x1x1,1x1x2,1x2x1", help="P x D x S, comma separated")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--links", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    started, load_before = time.perf_counter(), _load()
    torch.set_num_threads(1)  # each rank has one thread under torchrun / start_local_ranks
    model, (x, y) = _model_and_data(args)
    cap = capture(model, None, None, (x, y), {}, None, 1)
    graph, _ = transform(cap)
    cost = cost_model_from_graph(graph, cap.seq)
    sites = attention_sites(graph)
    calib = calibrate_compute(model, (x, y), cost, args.seq_len)

    reference = sppo_fx.compile(model, chunks=args.chunks, compile=False)
    ref_times = _steps(reference, model, x, y, args.steps)[1:]
    lengths = reference.plan.chunk_lengths

    runs, links = {}, None
    for k, layout in enumerate(args.layouts.split(",")):
        ranks = _launch(args, layout, links=(k == 0))
        if ranks[0]["links"]:
            links = {kind: LinkModel(*v) for kind, v in ranks[0]["links"].items()}
        runs[layout] = ranks
    load_after = _load()

    cfg = model.config
    hidden = getattr(cfg, "dim", None) or cfg.n_embd
    params = [q.numel() * q.element_size() for q in model.parameters()]
    uses = {}
    for _, q in model.named_parameters(remove_duplicate=False):
        uses[id(q)] = (q, uses.get(id(q), (q, 0))[1] + 1)
    tied = [q.numel() * q.element_size() for q, n in uses.values() if n > 1]
    common = dict(sites=sites, param_bytes=params, tied_param_bytes=tied,
                  boundary_bytes_per_token=args.batch * hidden * 4,
                  link_all_to_all=links["all-to-all"], link_all_reduce=links["all-reduce"],
                  link_p2p=links.get("p2p", links["all-to-all"]))
    rows, records = [], []

    def row(name, times, pred, counted, ranks=()):
        med = statistics.median(times)
        comm = sum(pred.comm_seconds.values())
        # the last step outside the blocking collectives (the slower rank): compare with the
        # predicted compute; a pipeline's waits on receives stay in (the clock has the bubble)
        outside = max((r["steps"][-1] - r["seconds"]["all-to-all"] - r["seconds"]["all-reduce"] for r in ranks),
                      default=times[-1])
        rows.append((name, f"{med:.3f}", f"{min(times):.3f}-{max(times):.3f}", f"{pred.step_seconds:.3f}",
                     f"{med / pred.step_seconds:.2f}", f"{pred.compute_seconds:.3f}", f"{outside:.3f}", f"{comm:.3f}",
                     _mib(sum(pred.comm_bytes.values())), _mib(counted) if counted is not None else "-"))
        records.append({"layout": name, "measured_s": times, "predicted_s": pred.step_seconds,
                        "predicted_compute_s": pred.compute_seconds, "predicted_comm_s": pred.comm_seconds,
                        "predicted_bytes": pred.comm_bytes, "predicted_calls": pred.comm_calls,
                        "counted_bytes": counted,
                        "ranks": [{k: r[k] for k in ("steps", "bytes", "calls", "seconds")} for r in ranks]})

    row("1 process", ref_times, predict_layout(cost, calib.compute, lengths, **common), None)
    details = []
    for layout, ranks in runs.items():
        pp, dp, sp = _layout(layout)
        if ranks[0]["chunk_lengths"] != lengths:
            raise SystemExit(f"layout {layout} ran chunks {ranks[0]['chunk_lengths']}, the reference {lengths}")
        per_step = [max(r["steps"][i] for r in ranks) for i in range(1, args.steps + 1)]
        pred = predict_layout(cost, calib.compute, lengths, pp, dp, sp, **common)
        counted = max(sum(r["bytes"].values()) for r in ranks)
        row(f"P={pp} D={dp} S={sp}", per_step, pred, counted, ranks)
        for kind in KINDS:
            got = [r["bytes"][kind] for r in ranks]
            if pred.comm_bytes[kind] or any(got):
                details.append((f"P={pp} D={dp} S={sp}", kind, pred.comm_calls[kind],
                                "/".join(str(r["calls"][kind]) for r in ranks), _mib(pred.comm_bytes[kind]),
                                "/".join(_mib(g) for g in got), f"{pred.comm_seconds[kind] * 1e3:.1f}",
                                "/".join(f"{r['seconds'][kind] * 1e3:.1f}" for r in ranks)))

    print(f"\nsppo_fx scale-out benchmark: {args.model}-{args.size}, T={args.seq_len}, batch {args.batch}, "
          f"chunks {lengths}, {args.steps} timed steps after 1 warm-up, 1 thread per rank")
    print(f"calibration (1 thread, out of sample): {calib.describe()}")
    print("links (gloo, loopback, 2 ranks): " + "; ".join(
        f"{k} {v.latency_s * 1e6:.0f} us + {v.bytes_per_s / 1e9:.2f} GB/s" for k, v in links.items()))
    print(tabulate(rows, headers=["layout", "measured s (median)", "spread (min-max)", "predicted s",
                                  "measured / predicted", "pred. compute s", "meas. outside collectives s",
                                  "pred. comm s",
                                  "pred. MiB sent/rank", "counted MiB sent/rank"], tablefmt="github"))
    print("\ncommunication per step, predicted against counted at run time (per rank, rank 0 / rank 1):")
    print(tabulate(details, headers=["layout", "kind", "pred. calls", "counted calls", "pred. MiB", "counted MiB",
                                     "pred. ms", "measured ms"], tablefmt="github"))
    print("(meas. outside collectives: the last timed step less its time inside all-to-alls and all-reduces, "
          "slower rank)")
    print("(measured ms: time inside the blocking collectives, waiting for the slower peer included; for p2p "
          "the pipeline's waits on receives, which include its fill/drain bubble)")
    print(f"\nload before: {load_before}\nload after:  {load_after}\n"
          f"wall time {time.perf_counter() - started:.0f} s. Two ranks share 2 cores with whatever else runs: "
          "the ratios say whether each layout's model holds, not how it scales (see the docstring).")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python bench/scale.py " + " ".join(sys.argv[1:]), "args": vars(args),
                       "chunk_lengths": lengths, "load_before": load_before, "load_after": load_after, "calibration": calib.describe(),
                       "links": {k: [v.latency_s, v.bytes_per_s] for k, v in links.items()},
                       "rows": records}, f, indent=1)


if __name__ == "__main__":
    main()
