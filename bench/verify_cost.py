"""The cost of `sppo_fx.compile(..., verify=True)`: the time of its check (an eager and a
chunked pass, forward and backward, over the plan's first chunks), as a ratio to one
steady training step of the same compiled model, side by side in one process.

The model is first compiled and stepped without the check, so that Inductor's compiles
are in its cache when the checked instance runs: the ratio counts the check's own work,
not compiles the first step would do anyway.

Usage::

    python bench/verify_cost.py                       # bench model, T = 4096, 8 chunks
    python bench/verify_cost.py --size tiny --seq-len 256 --steps 2
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sppo_fx  # noqa: E402
from sppo_fx.api import SppoCompiled  # noqa: E402
from sppo_fx.models import build  # noqa: E402
from sppo_fx.verify import prefix_plan  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", default="llama")
    ap.add_argument("--size", default="bench")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="steady steps timed (after the first)")
    ap.add_argument("--no-compile", action="store_true", help="compile=False (eager chunk programs)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = build(args.kind, args.size)
    x = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len))
    y = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len))
    options = dict(chunks=args.chunks, compile=not args.no_compile)

    plain = sppo_fx.compile(model, **options)
    plain(x, y).backward()  # the first call: capture and compiles
    steps = []
    for _ in range(args.steps):
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        plain(x, y).backward()
        steps.append(time.perf_counter() - t)
    step = min(steps)

    spent = []
    original = SppoCompiled._verify

    def timed(self, *a, **k):
        t = time.perf_counter()
        try:
            return original(self, *a, **k)
        finally:
            spent.append(time.perf_counter() - t)

    SppoCompiled._verify = timed
    model.zero_grad(set_to_none=True)
    checked = sppo_fx.compile(model, verify=True, **options)
    checked(x, y).backward()
    SppoCompiled._verify = original
    out = {"model": f"{args.kind}-{args.size}", "seq_len": args.seq_len, "chunks": args.chunks,
           "prefix_tokens": prefix_plan(checked.plan).seq_len, "step_s": round(step, 3), "verify_s": round(spent[0], 3),
           "verify_per_step": round(spent[0] / step, 3), "compile": not args.no_compile}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
