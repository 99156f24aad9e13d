"""`sppo-fx` command line (also `python -m sppo_fx`)."""
from __future__ import annotations

import argparse
import sys

import torch


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
    p_explain.add_argument("--seq-len", type=int, default=64)
    p_explain.add_argument("--batch", type=int, default=1)
    p_explain.add_argument("--chunks", type=int, default=4)
    p_explain.add_argument("--graphs", action="store_true", help="also print every transformed graph")
    p_explain.add_argument("--compile", action="store_true", help="compile with Inductor and list its generated code")
    p_explain.set_defaults(func=_explain)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
