"""`sppo-fx` command line (also `python -m sppo_fx`)."""
from __future__ import annotations

import argparse
import os
import sys

import torch

from sppo_fx.util.units import positive_int


def _bytes(text: str) -> int:
    """argparse type: a size such as 256GiB (`units.parse_bytes`)."""
    from sppo_fx.errors import SppoError
    from sppo_fx.util.units import parse_bytes
    try:
        return parse_bytes(text, "size")
    except SppoError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _tokens(text: str) -> int:
    """argparse type: a sequence length such as 4M, 640K or 1000 (`planner.parse_tokens`)."""
    from sppo_fx.errors import SppoError
    from sppo_fx.whatif import parse_tokens
    try:
        return parse_tokens(text)
    except SppoError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _profile(text: str) -> str:
    """argparse type: a built-in device profile's name."""
    from sppo_fx.errors import SppoError
    from sppo_fx.solver.profiles import get_profile
    try:
        get_profile(text)
    except SppoError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _explain(args) -> int:
    import sppo_fx
    from sppo_fx.models import build
    model = build(args.model, args.size)
    vocab = model.config.vocab_size
    x = torch.randint(0, vocab, (args.batch, args.seq_len))
    compiled = sppo_fx.compile(model, chunks=args.chunks, compile=args.compile)
    with torch.no_grad():
        compiled(x, x)
    print(compiled.explain())
    if args.graphs:
        for name, gm in compiled.graphs.items():
            print(f"\n==== graph: {name} ====")
            print(gm.print_readable(print_output=False))
    return 0


def _add_whatif_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments shared by `plan` and `trace` (paper-scale what-if planning)."""
    from sppo_fx.whatif import MODELS
    p.add_argument("--model", default="gpt-7b", choices=sorted(MODELS) + ["custom"],
                   help="paper Table 2 model (or custom with --layers/--hidden/--heads)")
    p.add_argument("--layers", type=positive_int, default=None, help="override / custom: transformer blocks")
    p.add_argument("--hidden", type=positive_int, default=None, help="override / custom: hidden size")
    p.add_argument("--heads", type=positive_int, default=None, help="override / custom: attention heads")
    p.add_argument("--vocab", type=positive_int, default=None, help="override / custom: vocabulary (50257)")
    p.add_argument("--seq", type=_tokens, default="4M", help="tokens per sequence: 4M, 640K, 128k or an integer")
    p.add_argument("--gpus", type=positive_int, default=128, help="total GPUs = stages x sequence-parallel width")
    p.add_argument("--device", type=_profile, default="a100-80gb", help="device profile: a100-80gb, h100, h200")
    p.add_argument("--stages", type=positive_int, default=None, help="fix the pipeline size P")
    p.add_argument("--chunks", type=positive_int, default=None, help="fix the chunk count N")
    p.add_argument("--host-memory", type=_bytes, default="256GiB",
                   help="host memory per GPU for offloaded activations")
    p.add_argument("--no-shard-optimizer", action="store_true",
                   help="keep fp32 master weights and Adam states on every GPU (16 B/param)")


def _whatif_report(args):
    from sppo_fx.whatif import Cluster, get_model, parse_bytes, plan
    model = get_model(args.model, args.layers, args.hidden, args.heads, args.vocab)
    cluster = Cluster(host_memory_bytes=parse_bytes(args.host_memory, "--host-memory"))  # an int by now
    return plan(model, args.seq, args.gpus, args.device, cluster=cluster, stages=args.stages,
                chunks=args.chunks, shard_optimizer=not args.no_shard_optimizer)


def _plan(args) -> int:
    import json

    from sppo_fx.errors import SppoError
    from sppo_fx.whatif import format_report
    try:
        report = _whatif_report(args)
    except SppoError as e:
        print(f"sppo-fx plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_report(report))
    return 0


def _trace(args) -> int:
    from sppo_fx.errors import SppoError
    from sppo_fx.util.chrome_trace import render_text, simulated_trace, summarize_trace, write_trace
    from sppo_fx.whatif import report_simulation
    try:
        report = _whatif_report(args)
        sim = report_simulation(report, args.policy)
    except SppoError as e:
        print(f"sppo-fx trace: {e}", file=sys.stderr)
        return 2
    res = report.best if args.policy == "sppo" else report.baselines[args.policy]
    title = (f"{report.model.name} seq={report.seq_len} gpus={report.gpus} {report.profile.name} "
             f"{args.policy}: P={res.stages} D={res.seq_parallel} N={res.chunks} (simulated)")
    trace = simulated_trace(sim, title=title)
    write_trace(args.out, trace)
    n = sum(1 for e in trace["traceEvents"] if e.get("ph") == "X")
    print(f"wrote {args.out}: {n} events, {report.best.stages if args.policy == 'sppo' else res.stages} ranks "
          f"(one pipeline; each rank stands for the {res.seq_parallel} GPUs of its stage). "
          f"Simulated step {sim.step_seconds:.3f} s, bubble {sim.bubble_fraction:.1%} — a model "
          f"prediction. Open it in https://ui.perfetto.dev or chrome://tracing.")
    if args.summary:
        print(summarize_trace(trace))
        print(render_text(trace))
    return 0


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What one argument's type cannot see: how the arguments fit together (argparse errors)."""
    if args.command in ("plan", "trace"):
        if args.seq < args.gpus:
            parser.error(f"--seq {args.seq} gives some of the {args.gpus} GPUs no token: give --seq >= --gpus "
                         f"({args.gpus}) or fewer --gpus")
        if args.stages is not None and args.stages > args.gpus:
            parser.error(f"--stages {args.stages} is more than --gpus {args.gpus}: give --stages <= --gpus")
        if args.chunks is not None and args.chunks > args.seq:
            parser.error(f"--chunks {args.chunks} is more than the {args.seq} tokens of --seq: give fewer chunks")
    if args.command == "trace":
        where = os.path.dirname(os.path.abspath(args.out))
        if os.path.isdir(args.out) or not os.path.isdir(where):
            parser.error(f"--out {args.out!r}: give a file name in an existing directory")
    if args.command == "explain" and args.chunks > args.seq_len:
        parser.error(f"--chunks {args.chunks} is more than --seq-len {args.seq_len}: give --chunks <= --seq-len")


def main(argv: list[str] | None = None) -> int:
    from sppo_fx import demo
    parser = argparse.ArgumentParser(prog="sppo-fx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="train the Llama-style model on long byte sequences")
    demo.add_arguments(p_demo)
    p_demo.set_defaults(func=demo.main)
    p_explain = sub.add_parser("explain", help="the chunk plan and transformed graphs of a reference model")
    p_explain.add_argument("--model", choices=["gpt", "llama"], default="llama")
    p_explain.add_argument("--size", choices=["tiny", "small", "bench"], default="tiny")
    p_explain.add_argument("--seq-len", type=positive_int, default=64)
    p_explain.add_argument("--batch", type=positive_int, default=1)
    p_explain.add_argument("--chunks", type=positive_int, default=4)
    p_explain.add_argument("--graphs", action="store_true", help="also print every transformed graph")
    p_explain.add_argument("--compile", action="store_true", help="compile with Inductor and list its generated code")
    p_explain.set_defaults(func=_explain)
    p_plan = sub.add_parser("plan", help="what-if: the SPPO plan and predicted tokens/GPU/s of a "
                                         "paper-scale model (analytic, no graph capture)")
    _add_whatif_arguments(p_plan)
    p_plan.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p_plan.set_defaults(func=_plan)
    p_trace = sub.add_parser("trace", help="write the simulated Chrome/Perfetto trace of the plan "
                                           "that `plan` chooses")
    _add_whatif_arguments(p_trace)
    p_trace.add_argument("--out", default="trace.json", help="output JSON file")
    p_trace.add_argument("--policy", default="sppo",
                         choices=["sppo", "full_recompute", "naive_full_offload",
                                  "uniform_no_adaptive_offload"],
                         help="whose plan to trace")
    p_trace.add_argument("--summary", action="store_true", help="also print a text summary and an ASCII timeline of the trace")
    p_trace.set_defaults(func=_trace)
    from sppo_fx.benchmark import cli as bench_cli
    p_bench = sub.add_parser("bench", help="a grid of anchors (eager, torch.compile, checkpointing) and pass "
                                           "configurations (budget, chunks, offload, stages, ...), each row in "
                                           "its own process; table, JSON/CSV, Pareto picture",
                             description=bench_cli.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_cli.add_arguments(p_bench)
    p_bench.set_defaults(func=bench_cli.main)
    args = parser.parse_args(argv)
    _check(sub.choices[args.command], args)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
